// matmul16: y = x @ W.T for a weight affine-quantized in 16-input groups (GGUF's Q6_K,
// Q3_K, Q2_K as mlx_ferrum/layers/quantized16.py stores them), for the few rows of a
// decode step: one pass over the codes, where the pure-MLX reference
// (mlx_ferrum/kernels/quantized16.py) runs two MLX group-32 products.
//
// File layout: see paged_attention_decode.metal (documentation, then
// "// --- header ---", then "// --- body ---").
//
// Algorithm: a matrix-vector product over quantized rows, as MLX's affine qmv and
// llama.cpp's K-quant mat-vec kernels do it: one simdgroup per output row; lane l
// takes the 16-groups l, l + 32, ...; for each it decodes the 16 codes once and adds
// scale * sum(x * code) + bias * sum(x) for every input row (w = scale * code + bias);
// simd_sum adds the lanes.
//
// Launch (built by mlx_ferrum/kernels/quantized16.py):
//   grid        = (32, ceil(N / NUM_SIMD) * NUM_SIMD, 1) threads
//   threadgroup = (32, NUM_SIMD, 1): simdgroup s of a threadgroup serves one output row
// Inputs:
//   x       [ROWS, K] T, row-major, K a multiple of 32
//   w       [N, K * BITS / 32] uint32: code i of a row at bits [i * BITS, (i + 1) * BITS)
//           of the row's words read as one little-endian bit stream (MLX's packing)
//   scales  [2, N, K / 32] S: [0] the scale of each even 16-group (16-group 2g at
//           index g), [1] of each odd one
//   biases  [2, N, K / 32] S, the same layout
//   params  [8] int32: N, K
// Output:
//   y       [ROWS, N] OutT
// Template: T, S, OutT, BITS (2, 3, 4, 5, 6 or 8), ROWS (1-8), NUM_SIMD.
// --- header ---
// --- body ---
  const int lane = int(thread_index_in_simdgroup);
  const int o = int(thread_position_in_grid.y);
  const int n_out = params[0];
  const int k_in = params[1];
  if (o >= n_out) {
    return;  // the whole simdgroup shares this row: no lane is left waiting in simd_sum
  }
  const int groups = k_in / 16;
  const int groups32 = k_in / 32;
  const int64_t words_per_row = int64_t(k_in) * BITS / 32;
  const device uint32_t* row = w + int64_t(o) * words_per_row;
  const uint32_t mask = (1u << BITS) - 1u;

  float acc[ROWS];
  for (int m = 0; m < ROWS; ++m) {
    acc[m] = 0.0f;
  }
  for (int g = lane; g < groups; g += 32) {
    const int64_t at = (int64_t(g & 1) * n_out + o) * groups32 + (g >> 1);
    const float scale = float(scales[at]);
    const float bias = float(biases[at]);
    float code[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t bit = (int64_t(g) * 16 + i) * BITS;
      const int64_t word = bit >> 5;
      const uint32_t shift = uint32_t(bit & 31);
      uint32_t v = row[word] >> shift;
      if (shift + BITS > 32u) {
        v |= row[word + 1] << (32u - shift);  // the code runs into the next word
      }
      code[i] = float(v & mask);
    }
    for (int m = 0; m < ROWS; ++m) {
      const device T* xs = x + int64_t(m) * k_in + int64_t(g) * 16;
      float dot = 0.0f;
      float sum = 0.0f;
      for (int i = 0; i < 16; ++i) {
        const float xi = float(xs[i]);
        dot += xi * code[i];
        sum += xi;
      }
      acc[m] += scale * dot + bias * sum;
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    const float total = simd_sum(acc[m]);
    if (lane == 0) {
      y[int64_t(m) * n_out + o] = static_cast<OutT>(total);
    }
  }
