"""The confluent-kafka clients with the settings the delivery rules need, and the check that a broker lets
a config in."""
