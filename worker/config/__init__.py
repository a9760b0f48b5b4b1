"""The config: msgspec Structs (``settings``) read from one YAML file, with environment overrides and secret
references, every problem reported with the key path it names."""
