// Runs the NeMo RL golden cases (DIR/nemo-rl/*.json; the repository's are in tests/golden) through a running
// advantage server from C++, with the stubs protoc and grpc_cpp_plugin generate from
// proto/advantage/v1/advantage.proto, and checks every value with the golden tolerance,
// |got - want| <= 1e-5 + 1e-4 |want| against `expected` or `expected_f64` (the same checks as
// examples/node/golden.js).
//
//   golden TARGET GOLDEN_DIR [TOKEN_FILE]
//
// Reads each case with protobuf's JSON parser (into google.protobuf.Value), sets NeMo RL's config keys on the
// config message by field name through protobuf reflection, sends only the inputs ListEstimators declares for
// the estimator, and sends an x-request-id it expects echoed back. Prints one line per case and ends with
// "cpp golden: N passed, M failed"; exits 1 when a case failed.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include "advantage/v1/advantage.grpc.pb.h"

namespace pb = google::protobuf;
using advantage::v1::Tensor;

namespace {

const std::map<std::string, std::string> kRenames = {{"logprobs_policy", "logprobs"},
                                                     {"logprobs_reference", "reference_logprobs"}};

// The golden files write non-finite floats as strings.
double Number(const pb::Value& v) {
  if (v.kind_case() == pb::Value::kStringValue) {
    if (v.string_value() == "NaN") return NAN;
    if (v.string_value() == "Infinity") return INFINITY;
    if (v.string_value() == "-Infinity") return -INFINITY;
    throw std::runtime_error("not a number: " + v.string_value());
  }
  return v.number_value();
}

// Nested lists -> shape and row-major values.
void Flatten(const pb::Value& v, std::vector<int64_t>* shape, std::vector<double>* flat) {
  shape->clear();
  flat->clear();
  for (const pb::Value* level = &v; level->kind_case() == pb::Value::kListValue;) {
    shape->push_back(level->list_value().values_size());
    if (level->list_value().values_size() == 0) break;
    level = &level->list_value().values(0);
  }
  std::vector<const pb::Value*> stack = {&v};
  while (!stack.empty()) {  // depth first, in order
    const pb::Value* x = stack.back();
    stack.pop_back();
    if (x->kind_case() == pb::Value::kListValue) {
      for (int i = x->list_value().values_size() - 1; i >= 0; --i) stack.push_back(&x->list_value().values(i));
    } else {
      flat->push_back(Number(*x));
    }
  }
}

Tensor MakeTensor(const pb::Value& value, const std::string& hint) {
  std::vector<int64_t> shape;
  std::vector<double> flat;
  Flatten(value, &shape, &flat);
  Tensor t;
  for (int64_t d : shape) t.add_shape(d);
  std::string data;
  if (hint == "int64") {
    t.set_dtype(advantage::v1::DTYPE_INT64);
    for (double x : flat) {
      int64_t i = static_cast<int64_t>(x);
      data.append(reinterpret_cast<const char*>(&i), sizeof i);  // little-endian hosts
    }
  } else {
    t.set_dtype(advantage::v1::DTYPE_FLOAT32);
    for (double x : flat) {
      float f = static_cast<float>(x);
      data.append(reinterpret_cast<const char*>(&f), sizeof f);
    }
  }
  t.set_data(data);
  return t;
}

std::vector<double> Decode(const Tensor& t, std::string* error) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  std::vector<double> values(n);
  const std::string& data = t.data();
  if (t.dtype() == advantage::v1::DTYPE_FLOAT32 || t.dtype() == advantage::v1::DTYPE_UNSPECIFIED) {
    if (static_cast<int64_t>(data.size()) != 4 * n) *error = "byte count does not match the shape";
    else for (int64_t i = 0; i < n; ++i) { float f; std::memcpy(&f, data.data() + 4 * i, 4); values[i] = f; }
  } else if (t.dtype() == advantage::v1::DTYPE_FLOAT64) {
    if (static_cast<int64_t>(data.size()) != 8 * n) *error = "byte count does not match the shape";
    else std::memcpy(values.data(), data.data(), 8 * n);
  } else {
    *error = "unsupported dtype " + advantage::v1::DType_Name(t.dtype());
  }
  return values;
}

// Sets the request's estimator oneof to a config message with the NeMo config keys it has a field for.
void SetConfig(advantage::v1::ComputeAdvantageRequest* req, const std::string& estimator, const pb::Struct& config) {
  const pb::FieldDescriptor* field = req->GetDescriptor()->FindFieldByName(estimator);
  if (field == nullptr || field->containing_oneof() == nullptr)
    throw std::runtime_error("the schema has no estimator " + estimator);
  pb::Message* cfg = req->GetReflection()->MutableMessage(req, field);
  const pb::Reflection* r = cfg->GetReflection();
  const pb::Descriptor* d = cfg->GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    auto it = config.fields().find(f->name());
    if (it == config.fields().end() || it->second.kind_case() == pb::Value::kNullValue) continue;
    std::vector<const pb::Value*> items;
    if (f->is_repeated()) {
      for (const pb::Value& item : it->second.list_value().values()) items.push_back(&item);
    } else {
      items.push_back(&it->second);
    }
    for (const pb::Value* v : items) {
      bool rep = f->is_repeated();
      switch (f->cpp_type()) {
        case pb::FieldDescriptor::CPPTYPE_BOOL:
          rep ? r->AddBool(cfg, f, v->bool_value()) : r->SetBool(cfg, f, v->bool_value()); break;
        case pb::FieldDescriptor::CPPTYPE_DOUBLE:
          rep ? r->AddDouble(cfg, f, Number(*v)) : r->SetDouble(cfg, f, Number(*v)); break;
        case pb::FieldDescriptor::CPPTYPE_FLOAT:
          rep ? r->AddFloat(cfg, f, Number(*v)) : r->SetFloat(cfg, f, Number(*v)); break;
        case pb::FieldDescriptor::CPPTYPE_INT32:
          rep ? r->AddInt32(cfg, f, Number(*v)) : r->SetInt32(cfg, f, Number(*v)); break;
        case pb::FieldDescriptor::CPPTYPE_INT64:
          rep ? r->AddInt64(cfg, f, Number(*v)) : r->SetInt64(cfg, f, Number(*v)); break;
        case pb::FieldDescriptor::CPPTYPE_UINT32:
          rep ? r->AddUInt32(cfg, f, Number(*v)) : r->SetUInt32(cfg, f, Number(*v)); break;
        case pb::FieldDescriptor::CPPTYPE_UINT64:
          rep ? r->AddUInt64(cfg, f, Number(*v)) : r->SetUInt64(cfg, f, Number(*v)); break;
        case pb::FieldDescriptor::CPPTYPE_STRING:
          rep ? r->AddString(cfg, f, v->string_value()) : r->SetString(cfg, f, v->string_value()); break;
        case pb::FieldDescriptor::CPPTYPE_ENUM: {  // "k3" -> KL_TYPE_K3: the enum's prefix, the value in capitals
          std::string first = f->enum_type()->value(0)->name();
          std::string name = first.substr(0, first.size() - std::string("UNSPECIFIED").size());
          for (char c : v->string_value()) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
          const pb::EnumValueDescriptor* e = f->enum_type()->FindValueByName(name);
          if (e == nullptr) throw std::runtime_error(estimator + "." + f->name() + ": unknown value " + name);
          rep ? r->AddEnum(cfg, f, e) : r->SetEnum(cfg, f, e);
          break;
        }
        default:
          throw std::runtime_error(estimator + "." + f->name() + ": unsupported field type");
      }
    }
  }
}

// NeMo keyword arguments -> the declared service inputs, as Tensors.
void SetInputs(advantage::v1::ComputeAdvantageRequest* req, const pb::Struct& inputs,
               const std::vector<std::string>& declared) {
  std::map<std::string, std::string> hints;
  if (inputs.fields().count("dtype"))
    for (const auto& [k, v] : inputs.fields().at("dtype").struct_value().fields())
      if (v.kind_case() == pb::Value::kStringValue) hints[k] = v.string_value();
  std::map<std::string, std::pair<const pb::Value*, std::string>> offered;
  for (const auto& [name, value] : inputs.fields()) {
    if (name == "dtype") continue;
    if (name == "repeated_batch") {
      for (const auto& [key, component] : value.struct_value().fields()) offered[key] = {&component, hints[name]};
    } else {
      auto renamed = kRenames.find(name);
      offered[renamed == kRenames.end() ? name : renamed->second] = {&value, hints[name]};
    }
  }
  const std::string pattern = "<name>";
  for (const std::string& spec : declared) {
    bool is_pattern = spec.size() >= pattern.size() &&
                      spec.compare(spec.size() - pattern.size(), pattern.size(), pattern) == 0;
    std::string prefix = is_pattern ? spec.substr(0, spec.size() - pattern.size()) : spec;
    for (const auto& [key, offer] : offered)
      if (key == spec || (is_pattern && key.compare(0, prefix.size(), prefix) == 0))
        (*req->mutable_inputs())[key] = MakeTensor(*offer.first, offer.second);
  }
}

// "" when got is close to `expected` or `expected_f64`, else a description.
std::string Compare(const Tensor& t, const pb::Struct& c, const std::string& key) {
  std::string error;
  std::vector<double> got = Decode(t, &error);
  if (!error.empty()) return key + ": " + error;
  for (size_t i = 0; i < got.size(); ++i)
    if (!std::isfinite(got[i])) return key + ": non-finite output at " + std::to_string(i);
  std::vector<int64_t> got_shape(t.shape().begin(), t.shape().end());
  std::string failures;
  for (const std::string variant : {"expected", "expected_f64"}) {
    if (!c.fields().count(variant)) continue;
    const auto& section = c.fields().at(variant).struct_value().fields();
    if (!section.count(key) || section.at(key).kind_case() == pb::Value::kNullValue) continue;
    std::vector<int64_t> shape;
    std::vector<double> want;
    Flatten(section.at(key), &shape, &want);
    if (shape != got_shape) {
      failures += " | " + variant + ": shape differs";
      continue;
    }
    size_t bad = 0;
    while (bad < want.size() && (!std::isfinite(want[bad]) ||
                                 std::fabs(got[bad] - want[bad]) <= 1e-5 + 1e-4 * std::fabs(want[bad]))) ++bad;
    if (bad == want.size()) return "";
    std::ostringstream out;
    out << " | " << variant << ": position " << bad << " got " << got[bad] << " want " << want[bad];
    failures += out.str();
  }
  return key + ":" + (failures.empty() ? " nothing to compare" : failures);
}

std::vector<std::string> RunCase(advantage::v1::AdvantageService::Stub* stub, const std::string& token,
                                 const std::map<std::string, std::vector<std::string>>& declared, const pb::Struct& c) {
  const std::string id = c.fields().at("id").string_value(), estimator = c.fields().at("estimator").string_value();
  advantage::v1::ComputeAdvantageRequest req;
  SetConfig(&req, estimator, c.fields().at("config").struct_value());
  auto inputs = declared.find(estimator);
  if (inputs == declared.end()) return {"the server lists no estimator " + estimator};
  SetInputs(&req, c.fields().at("inputs").struct_value(), inputs->second);
  grpc::ClientContext ctx;
  const std::string request_id = "cpp-golden-" + id;
  ctx.AddMetadata("x-request-id", request_id);
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  advantage::v1::AdvantageResult res;
  grpc::Status status = stub->ComputeAdvantage(&ctx, req, &res);
  if (!status.ok()) return {"gRPC status " + std::to_string(status.error_code()) + ": " + status.error_message()};
  std::vector<std::string> problems;
  auto echoed = ctx.GetServerTrailingMetadata().find("x-request-id");
  if (echoed == ctx.GetServerTrailingMetadata().end() ||
      std::string(echoed->second.data(), echoed->second.size()) != request_id)
    problems.push_back("x-request-id not echoed");
  if (auto p = Compare(res.advantages(), c, "advantages"); !p.empty()) problems.push_back(p);
  const auto& expected = c.fields().at("expected").struct_value().fields();
  bool want_returns = expected.count("returns") && expected.at("returns").kind_case() != pb::Value::kNullValue;
  if (!want_returns && res.has_returns()) problems.push_back("returns: present, the reference has none");
  if (want_returns && !res.has_returns()) problems.push_back("returns: missing");
  if (want_returns && res.has_returns())
    if (auto p = Compare(res.returns(), c, "returns"); !p.empty()) problems.push_back(p);
  pb::Struct no_metrics;
  const pb::Struct& want_metrics = expected.count("metrics") ? expected.at("metrics").struct_value() : no_metrics;
  if (static_cast<size_t>(want_metrics.fields().size()) != static_cast<size_t>(res.metrics().size()))
    problems.push_back("metrics: different keys");
  for (const auto& [key, want] : want_metrics.fields()) {
    auto got = res.metrics().find(key);
    double w = Number(want);
    if (got == res.metrics().end() || !(std::fabs(got->second - w) <= 1e-5 + 1e-4 * std::fabs(w)))
      problems.push_back("metrics[" + key + "] differs");
  }
  return problems;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: golden TARGET GOLDEN_DIR [TOKEN_FILE]\n";
    return 2;
  }
  std::string token;
  if (argc > 3) {
    std::ifstream in(argv[3]);
    std::getline(in, token);
    token.erase(token.find_last_not_of(" \t\r\n") + 1);
  }
  std::vector<std::filesystem::path> files;
  std::filesystem::path dir = std::filesystem::path(argv[2]) / "nemo-rl";
  if (std::filesystem::is_directory(dir))
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.path().extension() == ".json") files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::cerr << "golden: no golden cases under " << dir << "\n";
    return 2;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto stub = advantage::v1::AdvantageService::NewStub(
      grpc::CreateCustomChannel(argv[1], grpc::InsecureChannelCredentials(), args));
  std::map<std::string, std::vector<std::string>> declared;
  {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    advantage::v1::ListEstimatorsResponse listed;
    grpc::Status status = stub->ListEstimators(&ctx, advantage::v1::ListEstimatorsRequest(), &listed);
    if (!status.ok()) {
      std::cerr << "golden: ListEstimators: gRPC status " << status.error_code() << ": " << status.error_message()
                << "\n";
      return 2;
    }
    for (const auto& e : listed.estimators())
      for (const auto& in : e.inputs()) declared[e.name()].push_back(in.name());
  }
  int passed = 0, failed = 0;
  for (const auto& file : files) {
    std::ifstream in(file);
    std::stringstream text;
    text << in.rdbuf();
    pb::Struct c;
    if (!pb::util::JsonStringToMessage(text.str(), &c).ok()) {
      std::cerr << "golden: " << file << ": not JSON\n";
      return 2;
    }
    std::vector<std::string> problems;
    try {
      problems = RunCase(stub.get(), token, declared, c);
    } catch (const std::exception& e) {
      problems = {e.what()};
    }
    const std::string id = c.fields().at("id").string_value();
    if (problems.empty()) {
      ++passed;
      std::cout << "ok   " << id << "\n";
    } else {
      ++failed;
      std::cout << "FAIL " << id << ":";
      for (const auto& p : problems) std::cout << " " << p << ";";
      std::cout << "\n";
    }
  }
  std::cout << "cpp golden: " << passed << " passed, " << failed << " failed" << std::endl;
  return failed == 0 && passed > 0 ? 0 : 1;
}
