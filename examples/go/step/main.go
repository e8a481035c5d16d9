// One GRPO call from Go: 2 prompts x 2 samples, 3 tokens each. Prints the request id the server echoed and
// the [4, 3] advantages. Build: examples/go/build.sh OUT_DIR; run: OUT_DIR/bin/step --target localhost:50051.
package main

import (
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"log"
	"math"
	"time"

	advantagev1 "advantage/v1"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// float32s and int64s encode a Tensor's data: raw little-endian, C-contiguous.
func float32s(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func int64s(v []int64) []byte {
	b := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(b[8*i:], uint64(x))
	}
	return b
}

func main() {
	target := flag.String("target", "localhost:50051", "host:port of the advantage service")
	flag.Parse()
	// Plaintext. This builds with Debian 12's grpc-go 1.33 as well as today's: on grpc-go >= 1.63 write
	// grpc.NewClient(..., grpc.WithTransportCredentials(insecure.NewCredentials()), ...) instead.
	conn, err := grpc.Dial("dns:///"+*target, grpc.WithInsecure(),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	client := advantagev1.NewAdvantageServiceClient(conn)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "x-request-id", "step-42")
	mask := make([]float32, 12)
	for i := range mask {
		mask[i] = 1
	}
	var trailer metadata.MD
	grpo := &advantagev1.GRPOConfig{NormalizeRewards: proto.Bool(true)} // optional fields are pointers
	res, err := client.ComputeAdvantage(ctx, &advantagev1.ComputeAdvantageRequest{
		Estimator: &advantagev1.ComputeAdvantageRequest_Grpo{Grpo: grpo},
		Inputs: map[string]*advantagev1.Tensor{
			"prompt_ids": {Dtype: advantagev1.DType_DTYPE_INT64, Shape: []int64{4}, Data: int64s([]int64{0, 0, 1, 1})},
			"rewards":    {Dtype: advantagev1.DType_DTYPE_FLOAT32, Shape: []int64{4}, Data: float32s([]float32{1, 0, 0.5, 0.5})},
			"mask":       {Dtype: advantagev1.DType_DTYPE_FLOAT32, Shape: []int64{4, 3}, Data: float32s(mask)},
		}}, grpc.Trailer(&trailer))
	if status.Code(err) == codes.InvalidArgument { // bad input: the message names the field and the fix
		log.Fatalf("invalid request: %s", status.Convert(err).Message())
	} else if err != nil {
		log.Fatal(err)
	}
	adv := res.Advantages // [B, T] float32 unless the request set output_dtype
	values := make([]float32, len(adv.Data)/4)
	for i := range values {
		values[i] = math.Float32frombits(binary.LittleEndian.Uint32(adv.Data[4*i:]))
	}
	fmt.Println(trailer.Get("x-request-id"), adv.Shape, values)
}
