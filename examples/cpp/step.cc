// One GRPO call from C++: 2 prompts x 2 samples, 3 tokens each. Prints the request id the server echoed and the
// [4, 3] advantages. Build: examples/cpp/build.sh OUT_DIR; run: OUT_DIR/step localhost:50051.
#include <cstdint>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "advantage/v1/advantage.grpc.pb.h"

int main(int argc, char** argv) {
  std::string target = argc > 1 ? argv[1] : "localhost:50051";
  auto stub = advantage::v1::AdvantageService::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));

  advantage::v1::ComputeAdvantageRequest req;
  req.mutable_grpo()->set_normalize_rewards(true);
  auto add = [&req](const std::string& name, advantage::v1::DType dtype, std::vector<int64_t> shape,
                    const void* data, size_t nbytes) {
    advantage::v1::Tensor& t = (*req.mutable_inputs())[name];
    t.set_dtype(dtype);
    for (int64_t d : shape) t.add_shape(d);
    t.set_data(data, nbytes);  // raw little-endian bytes, C-contiguous (x86 and ARM hosts are little-endian)
  };
  std::vector<int64_t> prompt_ids = {0, 0, 1, 1};
  std::vector<float> rewards = {1, 0, 0.5, 0.5};
  std::vector<float> mask(4 * 3, 1.0f);
  add("prompt_ids", advantage::v1::DTYPE_INT64, {4}, prompt_ids.data(), prompt_ids.size() * sizeof(int64_t));
  add("rewards", advantage::v1::DTYPE_FLOAT32, {4}, rewards.data(), rewards.size() * sizeof(float));
  add("mask", advantage::v1::DTYPE_FLOAT32, {4, 3}, mask.data(), mask.size() * sizeof(float));

  grpc::ClientContext ctx;
  ctx.AddMetadata("x-request-id", "step-42");
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  advantage::v1::AdvantageResult res;
  grpc::Status status = stub->ComputeAdvantage(&ctx, req, &res);
  if (!status.ok()) {  // INVALID_ARGUMENT for bad input: the message names the field and the fix
    std::cerr << "error " << status.error_code() << ": " << status.error_message() << "\n";
    return 1;
  }
  const advantage::v1::Tensor& adv = res.advantages();  // [B, T] float32 unless the request set output_dtype
  std::vector<float> values(adv.data().size() / sizeof(float));
  std::memcpy(values.data(), adv.data().data(), adv.data().size());
  auto echoed = ctx.GetServerTrailingMetadata().find("x-request-id");
  std::cout << std::string(echoed->second.data(), echoed->second.size()) << " [" << adv.shape(0) << ", "
            << adv.shape(1) << "]";
  for (float v : values) std::cout << " " << v;
  std::cout << "\n";
  return 0;
}
