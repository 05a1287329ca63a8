// The attention kernels of flash_attention.cpp built for head_dim 128 (Qwen2.5 from 1.5B, Qwen3, Llama 3.x 3B and
// 8B, Mistral 7B): the same source, with kDim = 128 and every entry point named *_d128.
#define PREFIXKV_HEAD_DIM 128
#include "flash_attention.cpp"
