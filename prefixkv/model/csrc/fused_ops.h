// The one-pass bf16 elementwise kernels of fused/fused_ops.cpp on raw rows: what its tensor functions run on each
// row, for callers that own their buffers (decode_layers.cpp). Rows are `dim` contiguous bf16 at the strides given.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace prefixkv::ops {

using bf16 = c10::BFloat16;

// out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight), sums in float32; dim % 16 == 0
void rms_norm_row(const bf16* x, const bf16* weight, bf16* out, int64_t dim, float eps);

// out[i] = bf16(silu(gate[i])) * up[i] for i < inter; inter % 16 == 0
void silu_mul_row(const bf16* gate, const bf16* up, bf16* out, int64_t inter);

// heads rows of d (at head_stride) rotated by cos / sin [d] into out [heads, d]; d % 32 == 0
void rotary_row(const bf16* x, int64_t heads, int64_t head_stride, const bf16* cos, const bf16* sin, bf16* out,
                int64_t dim);

// h[i] = bf16(h[i] + y[i]): torch's bf16 add_, rounded to nearest even; dim % 16 == 0
void add_row(bf16* h, const bf16* y, int64_t dim);

}  // namespace prefixkv::ops
