{{/*
Secrets and certificates. Every secret comes from an existing Kubernetes Secret: a password becomes an env var
(secretKeyRef) that the config names as ${env:VAR}, a certificate a file of a Secret volume that the config
names by path. The ConfigMap holds references only.
*/}}

{{/* The env vars the chart sets from Secrets, as JSON [{"name", "secret", "key"}]. */}}
{{- define "kiw.secretEnv" -}}
{{- $s := .Values.secrets }}
{{- $out := list }}
{{- if $s.kafkaSasl.enabled }}
{{- $out = append $out (dict "name" "KIW_SASL_USERNAME" "secret" $s.kafkaSasl.secretName "key" $s.kafkaSasl.usernameKey) }}
{{- $out = append $out (dict "name" "KIW_SASL_PASSWORD" "secret" $s.kafkaSasl.secretName "key" $s.kafkaSasl.passwordKey) }}
{{- end }}
{{- if and $s.kafkaTls.enabled $s.kafkaTls.keyPasswordKey }}
{{- $out = append $out (dict "name" "KIW_KAFKA_KEY_PASSWORD" "secret" $s.kafkaTls.secretName "key" $s.kafkaTls.keyPasswordKey) }}
{{- end }}
{{- if $s.redisPassword.enabled }}
{{- $out = append $out (dict "name" "KIW_REDIS_PASSWORD" "secret" $s.redisPassword.secretName "key" $s.redisPassword.key) }}
{{- if $s.redisPassword.usernameKey }}
{{- $out = append $out (dict "name" "KIW_REDIS_USERNAME" "secret" $s.redisPassword.secretName "key" $s.redisPassword.usernameKey) }}
{{- end }}
{{- end }}
{{- $out | toJson }}
{{- end }}

{{/*
The Secret volumes of certificates, as JSON [{"volume", "secret", "mountPath", "files": {<Secret key>: <path>}}]:
each Secret key is mounted as a file of the same name under mountPath.
*/}}
{{- define "kiw.tlsVolumes" -}}
{{- $out := list }}
{{- range $side := list "kafkaTls" "redisTls" }}
{{- $t := get $.Values.secrets $side }}
{{- if $t.enabled }}
{{- $files := dict }}
{{- range $k := list $t.caKey $t.certKey $t.keyKey }}
{{- if $k }}{{ $_ := set $files $k (printf "%s/%s" (trimSuffix "/" $t.mountPath) $k) }}{{ end }}
{{- end }}
{{- $vol := ternary "kafka-tls" "redis-tls" (eq $side "kafkaTls") }}
{{- /* TLS to a public CA without a client certificate needs no file. */}}
{{- if $files }}
{{- $out = append $out (dict "volume" $vol "secret" $t.secretName "mountPath" $t.mountPath "files" $files "from" (printf "secrets.%s" $side)) }}
{{- end }}
{{- end }}
{{- end }}
{{- $out | toJson }}
{{- end }}

{{/* The path a TLS Secret key is mounted at: (dict "ctx" . "side" "kafkaTls" "key" <Secret key>), "" for no key. */}}
{{- define "kiw.tlsPath" -}}
{{- $t := get .ctx.Values.secrets .side }}
{{- if .key }}{{ printf "%s/%s" (trimSuffix "/" $t.mountPath) .key }}{{ end }}
{{- end }}

{{/*
Sets .key of the map .props to .value; fails when the user's config already holds another value there (the
chart owns the key while .from is on, and two sources for one setting would leave one of them ignored).
*/}}
{{- define "kiw.own" -}}
{{- if and (hasKey .props .key) (ne (toString (get .props .key)) (toString .value)) }}
{{- /* A secret the user put in config stays out of the message. */}}
{{- $shown := ternary "(a value)" (toString (get .props .key)) (regexMatch "(?i)password|secret|token" .key) }}
{{- fail (printf "%s.%s=%s conflicts with %s, which sets it to %v: remove it from config (or turn %s off)" .path .key $shown .from .value .from) }}
{{- end }}
{{- $_ := set .props .key .value }}
{{- end }}

{{/* The librdkafka properties the chart sets on both Kafka clients, as JSON {prop: [value, "from"]}. */}}
{{- define "kiw.kafkaOwnedProps" -}}
{{- $s := .Values.secrets }}
{{- $props := dict }}
{{- if $s.kafkaSasl.enabled }}
{{- $_ := set $props "sasl.username" (list "${env:KIW_SASL_USERNAME}" "secrets.kafkaSasl") }}
{{- $_ := set $props "sasl.password" (list "${env:KIW_SASL_PASSWORD}" "secrets.kafkaSasl") }}
{{- with $s.kafkaSasl.mechanism }}{{ $_ := set $props "sasl.mechanism" (list . "secrets.kafkaSasl.mechanism") }}{{ end }}
{{- end }}
{{- if $s.kafkaTls.enabled }}
{{- $_ := set $props "security.protocol" (list (ternary "SASL_SSL" "SSL" $s.kafkaSasl.enabled) "secrets.kafkaTls") }}
{{- with $s.kafkaTls.caKey }}
{{- $_ := set $props "ssl.ca.location" (list (include "kiw.tlsPath" (dict "ctx" $ "side" "kafkaTls" "key" .)) "secrets.kafkaTls") }}
{{- end }}
{{- if $s.kafkaTls.certKey }}
{{- $_ := set $props "ssl.certificate.location" (list (include "kiw.tlsPath" (dict "ctx" $ "side" "kafkaTls" "key" $s.kafkaTls.certKey)) "secrets.kafkaTls") }}
{{- $_ := set $props "ssl.key.location" (list (include "kiw.tlsPath" (dict "ctx" $ "side" "kafkaTls" "key" $s.kafkaTls.keyKey)) "secrets.kafkaTls") }}
{{- end }}
{{- if $s.kafkaTls.keyPasswordKey }}
{{- $_ := set $props "ssl.key.password" (list "${env:KIW_KAFKA_KEY_PASSWORD}" "secrets.kafkaTls.keyPasswordKey") }}
{{- end }}
{{- else if and $s.kafkaSasl.enabled $s.kafkaSasl.mechanism }}
{{- $_ := set $props "security.protocol" (list "SASL_PLAINTEXT" "secrets.kafkaSasl.mechanism") }}
{{- end }}
{{- $props | toJson }}
{{- end }}

{{/* redis.url with the ACL user (secrets.redisPassword.usernameKey) and the client certificate (secrets.redisTls). */}}
{{- define "kiw.redisUrl" -}}
{{- $s := .ctx.Values.secrets }}
{{- $url := .url }}
{{- if and $s.redisPassword.enabled $s.redisPassword.usernameKey }}
{{- $scheme := splitList "://" $url | first }}
{{- $rest := trimPrefix (printf "%s://" $scheme) $url }}
{{- if contains "@" (splitList "/" $rest | first) }}
{{- fail "config.redis.url carries a user (user@host) and secrets.redisPassword.usernameKey sets one too: remove it from the URL" }}
{{- end }}
{{- $url = printf "%s://${env:KIW_REDIS_USERNAME}@%s" $scheme $rest }}
{{- end }}
{{- if and $s.redisTls.enabled $s.redisTls.certKey }}
{{- if regexMatch "[?&]ssl_(certfile|keyfile)=" $url }}
{{- fail "config.redis.url sets ssl_certfile or ssl_keyfile and secrets.redisTls.certKey sets them too: remove them from the URL" }}
{{- end }}
{{- $cert := include "kiw.tlsPath" (dict "ctx" .ctx "side" "redisTls" "key" $s.redisTls.certKey) }}
{{- $key := include "kiw.tlsPath" (dict "ctx" .ctx "side" "redisTls" "key" $s.redisTls.keyKey) }}
{{- $url = printf "%s%sssl_certfile=%s&ssl_keyfile=%s" $url (ternary "&" "?" (contains "?" $url)) $cert $key }}
{{- end }}
{{- $url }}
{{- end }}

{{/* The worker config as rendered into the ConfigMap: .Values.config plus the settings the secrets above own. */}}
{{- define "kiw.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) }}
{{- $s := .Values.secrets }}
{{- $owned := include "kiw.kafkaOwnedProps" . | fromJson }}
{{- if $owned }}
{{- if not (get $cfg "kafka") }}{{ $_ := set $cfg "kafka" dict }}{{ end }}
{{- $kafka := get $cfg "kafka" }}
{{- range $side := list "consumer" "producer" }}
{{- if not (get $kafka $side) }}{{ $_ := set $kafka $side dict }}{{ end }}
{{- $props := get $kafka $side }}
{{- range $prop, $v := $owned }}
{{- include "kiw.own" (dict "props" $props "key" $prop "value" (index $v 0) "from" (index $v 1) "path" (printf "config.kafka.%s" $side)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if or $s.redisPassword.enabled $s.redisTls.enabled }}
{{- if not (get $cfg "redis") }}{{ $_ := set $cfg "redis" dict }}{{ end }}
{{- $redis := get $cfg "redis" }}
{{- $url := get $redis "url" | default "" | toString }}
{{- if not $url }}
{{- fail "secrets.redisPassword / secrets.redisTls need config.redis.url (without it the worker uses no Redis)" }}
{{- end }}
{{- if $s.redisPassword.enabled }}
{{- include "kiw.own" (dict "props" $redis "key" "password" "value" "${env:KIW_REDIS_PASSWORD}" "from" "secrets.redisPassword" "path" "config.redis") }}
{{- end }}
{{- if $s.redisTls.enabled }}
{{- if hasPrefix "unix://" $url }}
{{- fail "secrets.redisTls.enabled: config.redis.url is a unix:// socket, which has no TLS" }}
{{- end }}
{{- include "kiw.own" (dict "props" $redis "key" "tls" "value" true "from" "secrets.redisTls" "path" "config.redis") }}
{{- with $s.redisTls.caKey }}
{{- include "kiw.own" (dict "props" $redis "key" "tls_ca_file" "value" (include "kiw.tlsPath" (dict "ctx" $ "side" "redisTls" "key" .)) "from" "secrets.redisTls" "path" "config.redis") }}
{{- end }}
{{- end }}
{{- $_ := set $redis "url" (include "kiw.redisUrl" (dict "ctx" . "url" $url)) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
KEDA's TriggerAuthentication entries, as JSON [{"parameter", "name", "key", "from"}]: the same Secret keys the
worker reads (SASL credentials, the TLS files and the key's passphrase), then autoscaling.keda.extraSecretTargetRefs.
*/}}
{{- define "kiw.kedaSecretRefs" -}}
{{- $s := .Values.secrets }}
{{- $out := list }}
{{- if $s.kafkaSasl.enabled }}
{{- $out = append $out (dict "parameter" "username" "name" $s.kafkaSasl.secretName "key" $s.kafkaSasl.usernameKey "from" "secrets.kafkaSasl") }}
{{- $out = append $out (dict "parameter" "password" "name" $s.kafkaSasl.secretName "key" $s.kafkaSasl.passwordKey "from" "secrets.kafkaSasl") }}
{{- end }}
{{- if $s.kafkaTls.enabled }}
{{- range $param, $key := dict "ca" $s.kafkaTls.caKey "cert" $s.kafkaTls.certKey "key" $s.kafkaTls.keyKey "keyPassword" $s.kafkaTls.keyPasswordKey }}
{{- if $key }}{{ $out = append $out (dict "parameter" $param "name" $s.kafkaTls.secretName "key" $key "from" "secrets.kafkaTls") }}{{ end }}
{{- end }}
{{- end }}
{{- range $i, $r := (.Values.autoscaling.keda.extraSecretTargetRefs | default list) }}
{{- $out = append $out (dict "parameter" $r.parameter "name" $r.name "key" $r.key "from" (printf "autoscaling.keda.extraSecretTargetRefs[%d]" $i)) }}
{{- end }}
{{- $out | toJson }}
{{- end }}

{{/* Checks of the secrets block that values.schema.json cannot express. Included by kiw.validate. */}}
{{- define "kiw.validateSecrets" -}}
{{- $s := .Values.secrets }}
{{- range $name := list "kafkaSasl" "kafkaTls" "redisPassword" "redisTls" }}
{{- $v := get $s $name }}
{{- /* TLS with neither caKey nor certKey (a public CA, no client certificate) reads no Secret. */}}
{{- $reads := or (not (hasSuffix "Tls" $name)) $v.caKey $v.certKey }}
{{- if and $v.enabled $reads (not $v.secretName) }}
{{- fail (printf "secrets.%s.enabled needs secrets.%s.secretName (an existing Secret)" $name $name) }}
{{- end }}
{{- end }}
{{- range $name := list "kafkaTls" "redisTls" }}
{{- $v := get $s $name }}
{{- if and $v.enabled (ne (not $v.certKey) (not $v.keyKey)) }}
{{- fail (printf "secrets.%s: certKey and keyKey go together (a client certificate and its private key)" $name) }}
{{- end }}
{{- end }}
{{- if and $s.kafkaTls.enabled $s.kafkaTls.keyPasswordKey (not $s.kafkaTls.keyKey) }}
{{- fail "secrets.kafkaTls.keyPasswordKey without keyKey: the passphrase decrypts the client's private key" }}
{{- end }}
{{- if and $s.kafkaSasl.mechanism (not $s.kafkaSasl.enabled) }}
{{- fail "secrets.kafkaSasl.mechanism is set but secrets.kafkaSasl.enabled is false: enable it (with its Secret) or clear the mechanism" }}
{{- end }}
{{- if and $s.redisPassword.usernameKey (not $s.redisPassword.enabled) }}
{{- fail "secrets.redisPassword.usernameKey is set but secrets.redisPassword.enabled is false" }}
{{- end }}
{{- $mounts := dict "/etc/worker" "the config" "/tmp" "tmpVolume" }}
{{- range (include "kiw.tlsVolumes" . | fromJsonArray) }}
{{- if hasKey $mounts (trimSuffix "/" .mountPath) }}
{{- fail (printf "%s.mountPath=%s is already used by %s" .from .mountPath (get $mounts (trimSuffix "/" .mountPath))) }}
{{- end }}
{{- $_ := set $mounts (trimSuffix "/" .mountPath) .from }}
{{- end }}
{{- end }}
