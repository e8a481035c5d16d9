#!/usr/bin/env bash
# Builds the C++ examples (step.cc: one call; golden.cc: the NeMo RL golden cases) into OUT_DIR, generating the
# stubs from proto/ into OUT_DIR/gen with protoc and grpc_cpp_plugin. Debian 12: apt-get install g++ pkg-config
# protobuf-compiler protobuf-compiler-grpc libgrpc++-dev.
#
#   examples/cpp/build.sh OUT_DIR && OUT_DIR/step localhost:50051
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p "$1/gen"
out=$(cd "$1" && pwd)
protoc -I "$root/proto" --cpp_out="$out/gen" --grpc_out="$out/gen" \
  --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" advantage/v1/advantage.proto
CXX=${CXX:-g++}
CXXFLAGS=${CXXFLAGS:--std=c++17 -O1}
read -r -a cflags <<< "$(pkg-config --cflags grpc++ protobuf)"
read -r -a libs <<< "$(pkg-config --libs grpc++ protobuf)"
for unit in advantage.pb advantage.grpc.pb; do
  $CXX $CXXFLAGS "${cflags[@]}" -I "$out/gen" -c "$out/gen/advantage/v1/$unit.cc" -o "$out/$unit.o"
done
for program in step golden; do
  $CXX $CXXFLAGS "${cflags[@]}" -I "$out/gen" "$here/$program.cc" "$out/advantage.pb.o" "$out/advantage.grpc.pb.o" \
    "${libs[@]}" -o "$out/$program"
done
