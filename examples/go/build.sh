#!/usr/bin/env bash
# Builds the Go examples (step/: one call; golden/: the NeMo RL golden cases) into OUT_DIR/bin, generating the
# stubs from proto/ into OUT_DIR/src with protoc-gen-go and protoc-gen-go-grpc. Uses Debian 12's packages in
# GOPATH mode, offline (apt-get install golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc
# golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev): the generated package's import path is the
# .proto's go_package, "advantage/v1". In a module of your own, map it with
# --go_opt=Madvantage/v1/advantage.proto=example.com/you/advantagev1 (and the same --go-grpc_opt) instead.
#
#   examples/go/build.sh OUT_DIR && OUT_DIR/bin/step --target localhost:50051
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p "$1/src" "$1/bin"
out=$(cd "$1" && pwd)
protoc -I "$root/proto" --go_out="$out/src" --go-grpc_out="$out/src" advantage/v1/advantage.proto
for program in step golden; do
  rm -rf "${out:?}/src/$program" && cp -r "$here/$program" "$out/src/$program"
done
cd "$out/src"
GO111MODULE=off GOPATH="$out:/usr/share/gocode" GOFLAGS= GOPROXY=off go build -o "$out/bin/" step golden
