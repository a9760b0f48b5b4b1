# Chart cases for secrets and TLS (sourced by check_chart.sh; uses its render / good_case / bad_render /
# bad_manifest_from / has_all / pass / fail). Kafka over SASL_SSL (SCRAM) and over mutual TLS, Redis over
# TLS with an ACL user: every secret from a Secret, every certificate a file of a mounted Secret volume.
echo "security: SASL_SSL, mutual TLS, Redis TLS + ACL user"

# Mutual TLS without SASL: security.protocol SSL, the client certificate and key as mounted files, and KEDA
# given the same three Secret keys; no sasl anywhere.
good_case kafka-mtls --set autoscaling.enabled=true --set secrets.kafkaTls.enabled=true \
  --set secrets.kafkaTls.secretName=kiw-client --set secrets.kafkaTls.certKey=tls.crt --set secrets.kafkaTls.keyKey=tls.key
if has_all "$work/kafka-mtls.yaml" '        security.protocol: SSL' '        ssl.ca.location: /etc/kiw/kafka-tls/ca.crt' \
     '        ssl.certificate.location: /etc/kiw/kafka-tls/tls.crt' '        ssl.key.location: /etc/kiw/kafka-tls/tls.key' \
     '            secretName: "kiw-client"' '              - key: "tls.key"' '            defaultMode: 288' \
     '              mountPath: /etc/kiw/kafka-tls' '        tls: "enable"' '    - parameter: cert' '    - parameter: key' \
   && ! grep -qE 'sasl|parameter: username|ssl.key.password' "$work/kafka-mtls.yaml"; then
  pass "mutual TLS: SSL, certificate files from the Secret volume, KEDA cert/key from the same Secret"
else
  fail "mutual TLS: SSL, certificate files from the Secret volume, KEDA cert/key from the same Secret" \
    "$(grep -nE 'sasl|ssl\.|security|secretName|parameter|tls:' "$work/kafka-mtls.yaml")"
fi
# Without an fsGroup the Secret's files stay root's: the worker's uid reads them only world-readable (0444).
render kafka-mtls-no-fsgroup --set secrets.kafkaTls.enabled=true --set secrets.kafkaTls.secretName=s \
  --set podSecurityContext.fsGroup=null
if has_all "$work/kafka-mtls-no-fsgroup.yaml" '            defaultMode: 292'; then
  pass "TLS files 0440 with an fsGroup, 0444 without"
else
  fail "TLS files 0440 with an fsGroup, 0444 without" "$(grep -n defaultMode "$work/kafka-mtls-no-fsgroup.yaml"; cat "$work/kafka-mtls-no-fsgroup.err")"
fi
# SCRAM without TLS: SASL_PLAINTEXT; KEDA's trigger says scram_sha512 and no tls.
good_case kafka-scram-plaintext --set autoscaling.enabled=true --set secrets.kafkaSasl.enabled=true \
  --set secrets.kafkaSasl.secretName=kafka-user --set secrets.kafkaSasl.mechanism=SCRAM-SHA-512
if has_all "$work/kafka-scram-plaintext.yaml" '        security.protocol: SASL_PLAINTEXT' '        sasl.mechanism: SCRAM-SHA-512' \
     '        sasl: "scram_sha512"' '    - parameter: password' && ! grep -q ' tls:' "$work/kafka-scram-plaintext.yaml"; then
  pass "SCRAM without TLS: SASL_PLAINTEXT, KEDA scram_sha512 without tls"
else
  fail "SCRAM without TLS: SASL_PLAINTEXT, KEDA scram_sha512 without tls" \
    "$(grep -nE 'sasl|security|tls:' "$work/kafka-scram-plaintext.yaml")"
fi
# Redis over TLS with an ACL user and a client certificate: the user and password through env from the Secret, the
# CA and the certificate as files; the URL keeps its query options.
good_case redis-tls-acl --set 'config.redis.url=rediss://redis.cache:6380/2?health_check_interval=0' \
  --set secrets.redisPassword.enabled=true --set secrets.redisPassword.secretName=redis-acl \
  --set secrets.redisPassword.usernameKey=username --set secrets.redisTls.enabled=true \
  --set secrets.redisTls.secretName=redis-tls --set secrets.redisTls.certKey=tls.crt --set secrets.redisTls.keyKey=tls.key
if has_all "$work/redis-tls-acl.yaml" \
     '      url: rediss://${env:KIW_REDIS_USERNAME}@redis.cache:6380/2?health_check_interval=0&ssl_certfile=/etc/kiw/redis-tls/tls.crt&ssl_keyfile=/etc/kiw/redis-tls/tls.key' \
     '      password: ${env:KIW_REDIS_PASSWORD}' '      tls: true' '      tls_ca_file: /etc/kiw/redis-tls/ca.crt' \
     '            - name: KIW_REDIS_USERNAME' '                  name: "redis-acl"' '            secretName: "redis-tls"'; then
  pass "Redis TLS + ACL user: user/password from the Secret, CA and client certificate mounted"
else
  fail "Redis TLS + ACL user: user/password from the Secret, CA and client certificate mounted" \
    "$(grep -nE 'redis|url:|tls' "$work/redis-tls-acl.yaml")"
fi

# TLS to brokers with a public CA and no client certificate: SSL, no Secret, no volume, KEDA with tls only.
good_case kafka-tls-public-ca --set autoscaling.enabled=true --set secrets.kafkaTls.enabled=true --set secrets.kafkaTls.caKey=
if has_all "$work/kafka-tls-public-ca.yaml" '        security.protocol: SSL' '        tls: "enable"' \
   && ! grep -qE 'ssl\.|kafka-tls|TriggerAuthentication' "$work/kafka-tls-public-ca.yaml"; then
  pass "TLS with a public CA: SSL without a Secret volume or a TriggerAuthentication"
else
  fail "TLS with a public CA: SSL without a Secret volume or a TriggerAuthentication" \
    "$(grep -nE 'ssl|security|kafka-tls|tls:|^kind' "$work/kafka-tls-public-ca.yaml")"
fi

bad_render kafka-tls-no-secret "secrets.kafkaTls.enabled needs secrets.kafkaTls.secretName" --set secrets.kafkaTls.enabled=true
bad_render kafka-tls-cert-no-key "secrets.kafkaTls: certKey and keyKey go together" \
  --set secrets.kafkaTls.enabled=true --set secrets.kafkaTls.secretName=s --set secrets.kafkaTls.certKey=tls.crt
bad_render kafka-tls-key-password-no-key "keyPasswordKey without keyKey" \
  --set secrets.kafkaTls.enabled=true --set secrets.kafkaTls.secretName=s --set secrets.kafkaTls.keyPasswordKey=pw
bad_render kafka-tls-protocol-conflict "config.kafka.consumer.security.protocol=PLAINTEXT conflicts with secrets.kafkaTls" \
  --set secrets.kafkaTls.enabled=true --set secrets.kafkaTls.secretName=s \
  --set 'config.kafka.consumer.security\.protocol=PLAINTEXT'
# A secret written into config beside secrets.kafkaSasl: the error names the key, never the value.
bad_render sasl-password-in-config "config.kafka.producer.sasl.password=(a value) conflicts with secrets.kafkaSasl" \
  --set secrets.kafkaSasl.enabled=true --set secrets.kafkaSasl.secretName=s \
  --set 'config.kafka.producer.sasl\.password=hunter2'
if grep -q hunter2 "$work/sasl-password-in-config.err"; then
  fail "sasl-password-in-config: the error shows the password" "$(cat "$work/sasl-password-in-config.err")"
else
  pass "sasl-password-in-config: the error does not show the password"
fi
bad_render kafka-mechanism-without-sasl "secrets.kafkaSasl.mechanism is set but secrets.kafkaSasl.enabled is false" \
  --set secrets.kafkaSasl.mechanism=PLAIN
bad_render kafka-mechanism-unknown "secrets/kafkaSasl/mechanism" --set secrets.kafkaSasl.mechanism=SCRAM-SHA-1
bad_render kafka-tls-mount-tmp "secrets.kafkaTls.mountPath=/tmp is already used by tmpVolume" \
  --set secrets.kafkaTls.enabled=true --set secrets.kafkaTls.secretName=s --set secrets.kafkaTls.mountPath=/tmp
bad_render tls-mounts-collide "secrets.redisTls.mountPath=/etc/kiw/tls is already used by secrets.kafkaTls" \
  --set secrets.kafkaTls.enabled=true --set secrets.kafkaTls.secretName=s --set secrets.kafkaTls.mountPath=/etc/kiw/tls \
  --set config.redis.url=rediss://r:6379/0 --set secrets.redisTls.enabled=true --set secrets.redisTls.secretName=r \
  --set secrets.redisTls.mountPath=/etc/kiw/tls
bad_render redis-secrets-without-url "need config.redis.url" \
  --set secrets.redisPassword.enabled=true --set secrets.redisPassword.secretName=r
bad_render redis-user-twice "config.redis.url carries a user" --set config.redis.url=rediss://app@r:6379/0 \
  --set secrets.redisPassword.enabled=true --set secrets.redisPassword.secretName=r --set secrets.redisPassword.usernameKey=u
bad_render redis-tls-unix "unix:// socket, which has no TLS" --set config.redis.url=unix:///run/redis.sock \
  --set secrets.redisTls.enabled=true --set secrets.redisTls.secretName=r

# The validator refuses a rendering that inlines a secret, names a file no volume holds, or gives KEDA other
# Secret keys than the pod reads (the all-on rendering, altered).
bad_manifest_from all-on-keda inlined-sasl-password "sasl.password holds a value, not a \${env:...}" '
cm = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
cfg = yaml.safe_load(cm["data"]["config.yaml"]); cfg["kafka"]["producer"]["sasl.password"] = "hunter2"
cm["data"]["config.yaml"] = yaml.safe_dump(cfg)'
bad_manifest_from all-on-keda inlined-redis-url-password "config.redis.url carries a password" '
cm = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d["data"])
cfg = yaml.safe_load(cm["data"]["config.yaml"]); cfg["redis"]["url"] = "rediss://app:hunter2@r:6379/0"
cm["data"]["config.yaml"] = yaml.safe_dump(cfg)'
bad_manifest_from all-on-keda env-not-from-secret "KIW_SASL_PASSWORD}, which the pod does not set from a Secret" '
w = dep["spec"]["template"]["spec"]["containers"][0]
e = next(e for e in w["env"] if e["name"] == "KIW_SASL_PASSWORD"); e.pop("valueFrom"); e["value"] = "hunter2"'
bad_manifest_from all-on-keda ca-not-mounted "which no volume mounted in the worker container holds" '
w = dep["spec"]["template"]["spec"]["containers"][0]
w["volumeMounts"] = [m for m in w["volumeMounts"] if m["name"] != "kafka-tls"]'
bad_manifest_from all-on-keda keda-other-ca "TriggerAuthentication ca is" '
ta = next(d for d in docs if d["kind"] == "TriggerAuthentication")
next(r for r in ta["spec"]["secretTargetRef"] if r["parameter"] == "ca")["key"] = "other-ca.crt"'
bad_manifest_from all-on-keda keda-other-password "TriggerAuthentication password is" '
ta = next(d for d in docs if d["kind"] == "TriggerAuthentication")
next(r for r in ta["spec"]["secretTargetRef"] if r["parameter"] == "password")["name"] = "another-secret"'
bad_manifest_from all-on-keda keda-no-cert "the TriggerAuthentication has no cert" '
ta = next(d for d in docs if d["kind"] == "TriggerAuthentication")
ta["spec"]["secretTargetRef"] = [r for r in ta["spec"]["secretTargetRef"] if r["parameter"] != "cert"]'
bad_manifest_from all-on-keda keda-tls-off "trigger tls=None but the worker" '
so = next(d for d in docs if d["kind"] == "ScaledObject")
so["spec"]["triggers"][0]["metadata"].pop("tls")'
