// Runs the NeMo RL golden cases (tests/golden/nemo-rl/*.json of the repository, or --golden-dir DIR/nemo-rl)
// through a running advantage server from Go, with the stubs protoc-gen-go and protoc-gen-go-grpc generate from
// proto/advantage/v1/advantage.proto, and checks every value with the golden tolerance,
// |got - want| <= 1e-5 + 1e-4 |want| against `expected` or `expected_f64` (the same checks as
// examples/node/golden.js).
//
//	golden --target localhost:50051 --golden-dir tests/golden [--token-file F]
//
// Like the Python RemoteAdvantageEstimator it takes NeMo RL's config keys (set on the config message by field
// name through protobuf reflection), sends only the inputs ListEstimators declares for the estimator, and sends
// an x-request-id it expects echoed back. Prints one line per case and ends with "go golden: N passed, M failed";
// exits 1 when a case failed.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	advantagev1 "advantage/v1"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/reflect/protoreflect"
)

var renames = map[string]string{"logprobs_policy": "logprobs", "logprobs_reference": "reference_logprobs"}

// decode turns the golden files' "NaN" / "Infinity" / "-Infinity" strings into floats.
func decode(v interface{}) interface{} {
	switch x := v.(type) {
	case string:
		switch x {
		case "NaN":
			return math.NaN()
		case "Infinity":
			return math.Inf(1)
		case "-Infinity":
			return math.Inf(-1)
		}
	case []interface{}:
		for i := range x {
			x[i] = decode(x[i])
		}
	case map[string]interface{}:
		for k := range x {
			x[k] = decode(x[k])
		}
	}
	return v
}

// flatten: nested lists -> shape and row-major values.
func flatten(v interface{}) ([]int64, []float64) {
	var shape []int64
	for level := v; ; {
		list, ok := level.([]interface{})
		if !ok {
			break
		}
		shape = append(shape, int64(len(list)))
		if len(list) == 0 {
			break
		}
		level = list[0]
	}
	var flat []float64
	var walk func(interface{})
	walk = func(x interface{}) {
		if list, ok := x.([]interface{}); ok {
			for _, y := range list {
				walk(y)
			}
			return
		}
		flat = append(flat, x.(float64))
	}
	walk(v)
	return shape, flat
}

func tensor(value interface{}, hint string) *advantagev1.Tensor {
	shape, flat := flatten(value)
	if hint == "int64" {
		data := make([]byte, 8*len(flat))
		for i, x := range flat {
			binary.LittleEndian.PutUint64(data[8*i:], uint64(int64(x)))
		}
		return &advantagev1.Tensor{Dtype: advantagev1.DType_DTYPE_INT64, Shape: shape, Data: data}
	}
	data := make([]byte, 4*len(flat))
	for i, x := range flat {
		binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(float32(x)))
	}
	return &advantagev1.Tensor{Dtype: advantagev1.DType_DTYPE_FLOAT32, Shape: shape, Data: data}
}

func decodeTensor(t *advantagev1.Tensor) ([]int64, []float64, error) {
	n := int64(1)
	for _, d := range t.Shape {
		n *= d
	}
	values := make([]float64, n)
	switch t.Dtype {
	case advantagev1.DType_DTYPE_FLOAT32, advantagev1.DType_DTYPE_UNSPECIFIED:
		if int64(len(t.Data)) != 4*n {
			return nil, nil, fmt.Errorf("%d bytes for shape %v", len(t.Data), t.Shape)
		}
		for i := range values {
			values[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:])))
		}
	case advantagev1.DType_DTYPE_FLOAT64:
		if int64(len(t.Data)) != 8*n {
			return nil, nil, fmt.Errorf("%d bytes for shape %v", len(t.Data), t.Shape)
		}
		for i := range values {
			values[i] = math.Float64frombits(binary.LittleEndian.Uint64(t.Data[8*i:]))
		}
	default:
		return nil, nil, fmt.Errorf("unsupported dtype %v", t.Dtype)
	}
	return t.Shape, values, nil
}

// scalar converts one JSON value to the protobuf value of field f.
func scalar(estimator string, f protoreflect.FieldDescriptor, value interface{}) (protoreflect.Value, error) {
	switch f.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(value.(bool)), nil
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(value.(float64)), nil
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(float32(value.(float64))), nil
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(int32(value.(float64))), nil
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(int64(value.(float64))), nil
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(uint32(value.(float64))), nil
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(uint64(value.(float64))), nil
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(value.(string)), nil
	case protoreflect.EnumKind: // "k3" -> KL_TYPE_K3: the enum's prefix and the value in capitals
		values := f.Enum().Values()
		prefix := strings.TrimSuffix(string(values.Get(0).Name()), "UNSPECIFIED")
		if v := values.ByName(protoreflect.Name(prefix + strings.ToUpper(fmt.Sprint(value)))); v != nil {
			return protoreflect.ValueOfEnum(v.Number()), nil
		}
		return protoreflect.Value{}, fmt.Errorf("%s.%s: unknown value %v", estimator, f.Name(), value)
	}
	return protoreflect.Value{}, fmt.Errorf("%s.%s: unsupported field kind %v", estimator, f.Name(), f.Kind())
}

// setConfig sets the request's estimator oneof to a config message with the NeMo config keys it has a field for.
func setConfig(req *advantagev1.ComputeAdvantageRequest, estimator string, config map[string]interface{}) error {
	msg := req.ProtoReflect()
	field := msg.Descriptor().Fields().ByName(protoreflect.Name(estimator))
	if field == nil || field.ContainingOneof() == nil {
		return fmt.Errorf("the schema has no estimator %s", estimator)
	}
	cfg := msg.NewField(field).Message()
	fields := cfg.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		f := fields.Get(i)
		value, ok := config[string(f.Name())]
		if !ok || value == nil {
			continue
		}
		if f.IsList() { // e.g. GDPO's per-component weights
			list := cfg.Mutable(f).List()
			for _, item := range value.([]interface{}) {
				v, err := scalar(estimator, f, item)
				if err != nil {
					return err
				}
				list.Append(v)
			}
			continue
		}
		v, err := scalar(estimator, f, value)
		if err != nil {
			return err
		}
		cfg.Set(f, v)
	}
	msg.Set(field, protoreflect.ValueOfMessage(cfg))
	return nil
}

// inputsFor: NeMo keyword arguments -> the declared service inputs, as Tensors.
func inputsFor(caseInputs map[string]interface{}, declared []string) map[string]*advantagev1.Tensor {
	hints, _ := caseInputs["dtype"].(map[string]interface{})
	hint := func(name string) string { s, _ := hints[name].(string); return s }
	type offer struct {
		value interface{}
		hint  string
	}
	offered := map[string]offer{}
	for name, value := range caseInputs {
		switch name {
		case "dtype":
		case "repeated_batch":
			for key, component := range value.(map[string]interface{}) {
				offered[key] = offer{component, hint(name)}
			}
		default:
			key := name
			if renamed, ok := renames[name]; ok {
				key = renamed
			}
			offered[key] = offer{value, hint(name)}
		}
	}
	inputs := map[string]*advantagev1.Tensor{}
	for _, spec := range declared {
		for key, o := range offered {
			if key == spec || (strings.HasSuffix(spec, "<name>") && strings.HasPrefix(key, strings.TrimSuffix(spec, "<name>"))) {
				inputs[key] = tensor(o.value, o.hint)
			}
		}
	}
	return inputs
}

// compare returns "" when got is close to `expected` or `expected_f64`, else a description.
func compare(shape []int64, got []float64, c map[string]interface{}, key string) string {
	for i, g := range got {
		if math.IsNaN(g) || math.IsInf(g, 0) {
			return fmt.Sprintf("%s: non-finite output at %d", key, i)
		}
	}
	var failures []string
	for _, variant := range []string{"expected", "expected_f64"} {
		section, _ := c[variant].(map[string]interface{})
		want, ok := section[key]
		if !ok || want == nil {
			continue
		}
		wantShape, flat := flatten(want)
		if fmt.Sprint(wantShape) != fmt.Sprint(shape) {
			failures = append(failures, fmt.Sprintf("%s: shape %v != %v", variant, shape, wantShape))
			continue
		}
		bad := -1
		for i, w := range flat {
			if !math.IsNaN(w) && !math.IsInf(w, 0) && !(math.Abs(got[i]-w) <= 1e-5+1e-4*math.Abs(w)) {
				bad = i
				break
			}
		}
		if bad < 0 {
			return ""
		}
		failures = append(failures, fmt.Sprintf("%s: position %d got %v want %v", variant, bad, got[bad], flat[bad]))
	}
	if len(failures) == 0 {
		return key + ": nothing to compare"
	}
	return key + ": " + strings.Join(failures, " | ")
}

func runCase(client advantagev1.AdvantageServiceClient, token string, declared map[string][]string,
	c map[string]interface{}) []string {
	id, estimator := c["id"].(string), c["estimator"].(string)
	req := &advantagev1.ComputeAdvantageRequest{}
	if err := setConfig(req, estimator, c["config"].(map[string]interface{})); err != nil {
		return []string{err.Error()}
	}
	req.Inputs = inputsFor(c["inputs"].(map[string]interface{}), declared[estimator])
	requestID := "go-golden-" + id
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "x-request-id", requestID)
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	var trailer metadata.MD
	res, err := client.ComputeAdvantage(ctx, req, grpc.Trailer(&trailer))
	if err != nil {
		return []string{err.Error()}
	}
	var problems []string
	if echoed := trailer.Get("x-request-id"); len(echoed) != 1 || echoed[0] != requestID {
		problems = append(problems, fmt.Sprintf("x-request-id echoed %v, sent %s", echoed, requestID))
	}
	check := func(t *advantagev1.Tensor, key string) {
		shape, values, err := decodeTensor(t)
		if err != nil {
			problems = append(problems, key+": "+err.Error())
		} else if p := compare(shape, values, c, key); p != "" {
			problems = append(problems, p)
		}
	}
	check(res.Advantages, "advantages")
	expected := c["expected"].(map[string]interface{})
	switch {
	case expected["returns"] == nil && res.Returns != nil:
		problems = append(problems, "returns: present, the reference has none")
	case expected["returns"] != nil && res.Returns == nil:
		problems = append(problems, "returns: missing")
	case expected["returns"] != nil:
		check(res.Returns, "returns")
	}
	wantMetrics, _ := expected["metrics"].(map[string]interface{})
	if len(wantMetrics) != len(res.Metrics) {
		problems = append(problems, fmt.Sprintf("metrics: got %v want %v", res.Metrics, wantMetrics))
	}
	for key, want := range wantMetrics {
		got, ok := res.Metrics[key]
		w := want.(float64)
		if !ok || !(math.Abs(got-w) <= 1e-5+1e-4*math.Abs(w)) {
			problems = append(problems, fmt.Sprintf("metrics[%s]: got %v want %v", key, got, w))
		}
	}
	return problems
}

func run() (int, error) {
	target := flag.String("target", "localhost:50051", "host:port of the advantage service")
	goldenDir := flag.String("golden-dir", os.Getenv("ADVANTAGE_GOLDEN_DIR"), "directory with nemo-rl/*.json")
	tokenFile := flag.String("token-file", "", "file holding the bearer token")
	flag.Parse()
	token := ""
	if *tokenFile != "" {
		raw, err := os.ReadFile(*tokenFile)
		if err != nil {
			return 2, err
		}
		token = strings.TrimSpace(string(raw))
	}
	files, _ := filepath.Glob(filepath.Join(*goldenDir, "nemo-rl", "*.json"))
	if len(files) == 0 {
		return 2, fmt.Errorf("no golden cases under %s/nemo-rl: pass --golden-dir", *goldenDir)
	}
	sort.Strings(files)
	conn, err := grpc.Dial(*target, grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1<<30), grpc.MaxCallSendMsgSize(1<<30)))
	if err != nil {
		return 2, err
	}
	defer conn.Close()
	client := advantagev1.NewAdvantageServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	listed, err := client.ListEstimators(ctx, &advantagev1.ListEstimatorsRequest{})
	if err != nil {
		return 2, err
	}
	declared := map[string][]string{}
	for _, e := range listed.Estimators {
		for _, in := range e.Inputs {
			declared[e.Name] = append(declared[e.Name], in.Name)
		}
	}
	passed, failed := 0, 0
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			return 2, err
		}
		var c map[string]interface{}
		if err := json.Unmarshal(raw, &c); err != nil {
			return 2, fmt.Errorf("%s: %v", file, err)
		}
		decode(c)
		if problems := runCase(client, token, declared, c); len(problems) > 0 {
			failed++
			fmt.Printf("FAIL %s: %s\n", c["id"], strings.Join(problems, "; "))
		} else {
			passed++
			fmt.Printf("ok   %s\n", c["id"])
		}
	}
	fmt.Printf("go golden: %d passed, %d failed\n", passed, failed)
	if failed > 0 || passed == 0 {
		return 1, nil
	}
	return 0, nil
}

func main() {
	code, err := run()
	if err != nil {
		fmt.Fprintln(os.Stderr, "golden:", err)
	}
	os.Exit(code)
}
