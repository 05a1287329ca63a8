// Python bindings of prefixkv's native CPU kernels (see prefixkv/model/native.py).
#include <torch/extension.h>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens, int64_t page_size,
                                  double scale);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
bool has_fused_ops();
std::string fused_ops_isa();
std::vector<at::Tensor> paged_decode_attention_lse(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens,
                                                   int64_t page_size, double scale);
std::vector<at::Tensor> flash_attention(at::Tensor q, at::Tensor kv, at::Tensor slots, at::Tensor q_pos,
                                        double scale, c10::optional<at::Tensor> state_in, bool return_state,
                                        int64_t isa);
std::vector<at::Tensor> paged_flash_decode(at::Tensor q, at::Tensor kv, at::Tensor table, at::Tensor lens,
                                           int64_t page_size, double scale, c10::optional<at::Tensor> state_in,
                                           bool return_state, int64_t isa);
bool has_flash_attention();
std::string attention_isa();
at::Tensor gemm_pack(at::Tensor weight);
at::Tensor gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
bool has_gemm();
at::Tensor gemm_pack_f32(at::Tensor weight);
at::Tensor gemm_f32(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
bool has_gemm_f32();
std::string gemm_isa();
at::Tensor amx_gemm(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
at::Tensor amx_gemm_emulated(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias);
bool has_amx();
void bind_decode_layers(py::module_& m);
at::Tensor qgemm_pack(at::Tensor blocks, int64_t k, std::string format);
at::Tensor qgemm(at::Tensor x, at::Tensor packed, int64_t n, std::string format, c10::optional<at::Tensor> bias);
bool has_qgemm();
int64_t stream_read(const at::Tensor& buf);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV pool");
  m.def("paged_decode_attention_lse", &paged_decode_attention_lse,
        "paged_decode_attention that also returns each row's log-sum-exp");
  m.def("silu_mul", &silu_mul, "[T, 2I] -> silu(first half) * second half, one pass");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row in float32, scaled by weight, one pass");
  m.def("has_fused_ops", &has_fused_ops, "whether silu_mul, rms_norm and rotary are compiled in (AVX-512, AVX2)");
  m.def("fused_ops_isa", &fused_ops_isa, "the ISA of the compiled elementwise rows: avx512, avx2, or empty");
  m.def("flash_attention", &flash_attention,
        "bf16 attention of many query rows over pool slots with per-row causal limits; returns (out, lse[, state])",
        py::arg("q"), py::arg("kv"), py::arg("slots"), py::arg("q_pos"), py::arg("scale"),
        py::arg("state_in") = py::none(), py::arg("return_state") = false, py::arg("isa") = 0);
  m.def("paged_flash_decode", &paged_flash_decode,
        "decode attention over each sequence's pages, bit for bit flash_attention's arithmetic; (out, lse[, state])",
        py::arg("q"), py::arg("kv"), py::arg("table"), py::arg("lens"), py::arg("page_size"), py::arg("scale"),
        py::arg("state_in") = py::none(), py::arg("return_state") = false, py::arg("isa") = 0);
  m.def("has_flash_attention", &has_flash_attention,
        "whether flash_attention and paged_flash_decode are compiled in (AVX-512 BF16, or AVX2 + FMA)");
  m.def("attention_isa", &attention_isa,
        "the instruction set of the attention kernels' vector path (isa 0): avx512_bf16, avx2, or empty (none)");
  m.def("gemm_pack", &gemm_pack, "bf16 weight [N, K] -> the panel layout gemm reads", py::arg("weight"));
  m.def("gemm", &gemm, "x [M, K] bf16 @ packed weight^T (+ bias) -> [M, N] bf16; a row's bits never depend on M",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("has_gemm", &has_gemm, "whether gemm is compiled in (AVX-512 BF16, or AVX2 + FMA)");
  m.def("gemm_isa", &gemm_isa, "the instruction set gemm is compiled for: avx512_bf16, avx2, or empty (none)");
  m.def("gemm_pack_f32", &gemm_pack_f32, "fp32 weight [N, K] -> the panel layout gemm_f32 reads", py::arg("weight"));
  m.def("gemm_f32", &gemm_f32, "x [M, K] fp32 @ packed weight^T (+ bias) -> [M, N] fp32; a row's bits never depend on M",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("has_gemm_f32", &has_gemm_f32, "whether gemm_f32 is compiled in (the AVX2 build: a CPU without AVX-512 BF16)");
  m.def("amx_gemm", &amx_gemm, "gemm on AMX tiles (same packed weights, same row invariance)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("amx_gemm_emulated", &amx_gemm_emulated, "amx_gemm's kernels on emulated tiles (tests)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("bias") = py::none());
  m.def("qgemm_pack", &qgemm_pack, "GGUF blocks [N, K/32 * block bytes] (q8_0, q4_0, q4_1) -> the layout qgemm reads",
        py::arg("blocks"), py::arg("k"), py::arg("format"));
  m.def("qgemm", &qgemm,
        "x [M, K] bf16 @ dequantized weight^T (+ bias) -> [M, N] bf16, fp32 sums; a row's bits never depend on M",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("format"), py::arg("bias") = py::none());
  m.def("has_qgemm", &has_qgemm, "whether qgemm is compiled in (AVX-512)");
  m.def("has_amx", &has_amx, "whether this CPU and OS offer AMX tiles (and the kernels are compiled in)");
  m.def("stream_read", &stream_read, "read a contiguous tensor once on every intra-op thread (bandwidth probe)",
        py::arg("buf"));
  bind_decode_layers(m);
  m.def("rotary", &rotary, "rotate_half rotary embedding of [T, heads, d] by [T, 1, d] cos/sin, one pass");
}
