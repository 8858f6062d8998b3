#!/bin/sh
# Make the fleet's keys and store them in the cluster (docs/deploy.md "Kubernetes", docs/security.md):
#   deploy/k8s/make-keys.sh DIR        (needs `pip install 'kvserver[tls]'` and kubectl)
#
# DIR/server.key, server.key_secret  the daemons' CURVE pair (one for the fleet: peers admit it)
# DIR/vllm.key, vllm.key_secret      the engines' CURVE pair (listed in the daemons' clients dir)
# DIR/server.crt, server.pem         the daemons' TLS certificate (gRPC, peer stream) for "kvserver"
#                                    (clients dialling a node IP check that name: tls_server_name)
# DIR/auth.token                     the fleet's token (0600, `kvserver keys token`): every
#                                    request to a daemon carries it
# and in namespace kvserver:
#   Secret kvserver-curve            server.key, server.key_secret   -> the DaemonSet
#   ConfigMap kvserver-curve-clients server.key, vllm.key (public)   -> the DaemonSet's clients dir
#   Secret kvserver-tls              server.crt, server.pem          -> the DaemonSet
#   Secret kvserver-auth             auth.token                      -> the DaemonSet
#   Secret kvserver-engine-keys      server.key, vllm.key_secret, server.crt, auth.token
#                                                                    -> vLLM pods, routers
# KVSERVER (default: kvserver) and KUBECTL (default: kubectl) name the commands. Never
# overwrites a key: remove DIR to make new ones (then restart the DaemonSet and the engines).
set -eu
dir=${1:?usage: make-keys.sh DIR}
kvserver=${KVSERVER:-kvserver}
kubectl=${KUBECTL:-kubectl}
$kvserver keys curve "$dir" --name server
$kvserver keys curve "$dir" --name vllm
$kvserver keys tls "$dir" --name server --host kvserver --host kvserver-local.kvserver.svc --host 127.0.0.1
$kvserver keys token "$dir" --name auth
$kubectl -n kvserver create secret generic kvserver-curve \
    --from-file="$dir/server.key" --from-file="$dir/server.key_secret"
$kubectl -n kvserver create configmap kvserver-curve-clients \
    --from-file="$dir/server.key" --from-file="$dir/vllm.key"
$kubectl -n kvserver create secret generic kvserver-tls \
    --from-file="$dir/server.crt" --from-file="$dir/server.pem"
$kubectl -n kvserver create secret generic kvserver-auth --from-file="$dir/auth.token"
$kubectl -n kvserver create secret generic kvserver-engine-keys \
    --from-file="$dir/server.key" --from-file="$dir/vllm.key_secret" --from-file="$dir/server.crt" \
    --from-file="$dir/auth.token"
