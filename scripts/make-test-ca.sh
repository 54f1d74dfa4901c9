#!/bin/bash
# make-test-ca.sh DIR [HOST...]: a throwaway CA made with openssl, and certificates
# carrying ckpt identities (URI subjectAltNames, docs/security.md "Identities"), for
# the tests of what only openssl can make: revoked certificates and their CRL, a
# certificate of the CA without a ckpt identity, a second (rogue) CA. Not for
# production, nor for starting a cluster by hand: use `ckptctl certs` (the keys here
# are unencrypted and the CA lives next to them).
#
# Writes into DIR (created; mode 0700):
#   ca.pem ca.key                 the test CA
#   meta.pem meta.key             ckpt://meta, for ckpt-meta; valid for 127.0.0.1, ::1,
#                                 localhost and each HOST given
#   node-ID.pem node-ID.key       ckpt://node/ID, for the agent of node ID, one per id in
#                                 $TEST_CA_NODES (default "n0 n1"); hosts as meta.pem
#   admin.pem admin.key           ckpt://admin/test-admin (ckptctl: every command)
#   operator.pem operator.key     ckpt://operator/test-operator (read-only)
#   trainer.pem trainer.key       ckpt://trainer/test-trainer for the jobs in
#                                 $TEST_CA_TRAINER_JOBS (default "*")
#   client.pem client.key         a client certificate of the CA with no ckpt identity
#                                 (what servers refuse UNAUTHENTICATED)
#   rogue-ca.pem rogue.pem rogue.key  a second CA and an admin certificate it signed
#                                 (ckpt://admin/rogue: what every server must refuse)
#   revoked.pem revoked.key       ckpt://admin/revoked, signed by the CA, then revoked
#   revoked-server.pem .key       ckpt://meta (as meta.pem), revoked
#   crl/                          the CA's CRL revoking both, hashed for
#                                 --tls-crl-dir (openssl rehash)
# Needs the openssl command (Debian package openssl).
set -euo pipefail
dir=${1:?usage: make-test-ca.sh DIR [HOST...]}
shift
command -v openssl >/dev/null || { echo "make-test-ca.sh: openssl not found (apt-get install openssl)" >&2; exit 2; }
nodes=${TEST_CA_NODES:-n0 n1}
trainer_jobs=${TEST_CA_TRAINER_JOBS:-*}
mkdir -p "$dir"
chmod 0700 "$dir"
cd "$dir"
days=30
hosts="IP:127.0.0.1,IP:::1,DNS:localhost"
for h in "$@"; do
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then hosts="$hosts,IP:$h"; else hosts="$hosts,DNS:$h"; fi
done

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; chmod 0600 "$1"; }

ca() {  # ca NAME CN
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -sha256 -days $days -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$1.pem" 2>/dev/null
}

leaf() {  # leaf NAME CN CA EXT
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=${2//\//\\/}" -out "$1.csr" 2>/dev/null  # '/' in the CN escaped
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -days $days -sha256 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

server="extendedKeyUsage=serverAuth,clientAuth"  # daemons: servers, and callers of meta
client="extendedKeyUsage=clientAuth"
ca ca "ckpt test CA"
leaf meta "ckpt://meta" ca "subjectAltName=URI:ckpt://meta,$hosts
$server"
for n in $nodes; do
  leaf "node-$n" "ckpt://node/$n" ca "subjectAltName=URI:ckpt://node/$n,$hosts
$server"
done
leaf admin "ckpt://admin/test-admin" ca "subjectAltName=URI:ckpt://admin/test-admin
$client"
leaf operator "ckpt://operator/test-operator" ca "subjectAltName=URI:ckpt://operator/test-operator
$client"
jobs=""
set -f  # job patterns such as "*" are not file names
for j in $trainer_jobs; do jobs="$jobs,URI:ckpt://job/$j"; done
set +f
leaf trainer "ckpt://trainer/test-trainer" ca "subjectAltName=URI:ckpt://trainer/test-trainer$jobs
$client"
leaf client "ckpt-client" ca "$client"
ca rogue-ca "rogue CA"
leaf rogue "ckpt://admin/rogue" rogue-ca "subjectAltName=URI:ckpt://admin/rogue
$client"
leaf revoked "ckpt://admin/revoked" ca "subjectAltName=URI:ckpt://admin/revoked
$client"
leaf revoked-server "ckpt://meta" ca "subjectAltName=URI:ckpt://meta,$hosts
$server"
# A CRL of the test CA that revokes revoked.pem and revoked-server.pem (openssl ca keeps its state in
# ca-db/; only the CRL and its hash link are kept).
mkdir -p ca-db crl
: > ca-db/index.txt
echo 1000 > ca-db/crlnumber
printf '%s\n' "[ ca ]" "default_ca = test_ca" "[ test_ca ]" "database = ca-db/index.txt" \
  "crlnumber = ca-db/crlnumber" "default_md = sha256" "default_crl_days = $days" > ca-db/ca.cnf
openssl ca -config ca-db/ca.cnf -keyfile ca.key -cert ca.pem -revoke revoked.pem 2>/dev/null
openssl ca -config ca-db/ca.cnf -keyfile ca.key -cert ca.pem -revoke revoked-server.pem 2>/dev/null
openssl ca -config ca-db/ca.cnf -keyfile ca.key -cert ca.pem -gencrl -out crl/ca.crl.pem 2>/dev/null
openssl rehash crl >/dev/null 2>&1
rm -rf ca-db
rm -f ./*.srl
echo "make-test-ca.sh: wrote $(ls | tr '\n' ' ')in $dir"
