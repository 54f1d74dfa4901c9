#!/bin/bash
# make-test-ca.sh DIR [HOST...]: a throwaway CA and certificates for tests and
# for trying TLS by hand (docs/security.md). Not for production: the keys are
# unencrypted and the CA lives next to them.
#
# Writes into DIR (created; mode 0700):
#   ca.pem ca.key                 the test CA
#   server.pem server.key         for ckpt-meta and ckpt-agent; valid for
#                                 127.0.0.1, ::1, localhost and each HOST given
#   client.pem client.key         for ckptctl, trainers and agents (as callers)
#   rogue-ca.pem rogue.pem rogue.key  a second CA and a client it signed (what
#                                 a server must refuse)
#   revoked.pem revoked.key       a client the CA signed and then revoked
#   revoked-server.pem .key       a server certificate (as server.pem), revoked
#   elsewhere.pem elsewhere.key   a server certificate for another host only
#                                 (elsewhere.invalid: callers must refuse it)
#   crl/                          the CA's CRL revoking both, hashed for
#                                 --tls-crl-dir (openssl rehash)
# Needs the openssl command (Debian package openssl).
set -euo pipefail
dir=${1:?usage: make-test-ca.sh DIR [HOST...]}
shift
command -v openssl >/dev/null || { echo "make-test-ca.sh: openssl not found (apt-get install openssl)" >&2; exit 2; }
mkdir -p "$dir"
chmod 0700 "$dir"
cd "$dir"
days=30
san="IP:127.0.0.1,IP:::1,DNS:localhost"
for h in "$@"; do
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san="$san,IP:$h"; else san="$san,DNS:$h"; fi
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
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial -days $days -sha256 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "ckpt test CA"
leaf server "ckpt-server" ca "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
leaf client "ckpt-client" ca "extendedKeyUsage=clientAuth"
leaf elsewhere "ckpt-elsewhere" ca "subjectAltName=DNS:elsewhere.invalid
extendedKeyUsage=serverAuth,clientAuth"
ca rogue-ca "rogue CA"
leaf rogue "rogue-client" rogue-ca "extendedKeyUsage=clientAuth"
leaf revoked "ckpt-revoked-client" ca "extendedKeyUsage=clientAuth"
leaf revoked-server "ckpt-revoked-server" ca "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
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
