// AMX int8 tiles for the int4, Q8_0, K-quant and MXFP4 matmuls over many rows (amx.cpp).
#pragma once
#include <cstdint>

namespace fastdecode {

// q4_linear's tiles (160 bytes per pair of blocks), kq_linear's (592, 720, 840 bytes per super-block), q8_linear's
// pair tiles (272 bytes per pair of blocks), fp4_linear's MXFP4 tiles (136 bytes per pair of blocks)
enum class AmxFormat { Q4, Q4K, Q5K, Q6K, Q8, FP4 };

// From this many rows the tiles take the blocks of 32 weight rows they can. Measured (N 2048, K 1536, 2 threads): 16
// rows 0.28 ms on the tiles against 0.37 with VNNI, 12 rows equal, 8 rows 0.24 against 0.22: a pass costs about
// the same for 1 row as for 16 (unpacking the weights into the tiles' layout dominates), rows padded to 16 or 32.
constexpr int64_t AMX_MIN_ROWS = 16;

// The same without the tiles (VNNI or AVX2 over their layout): measured with prefill's shapes (see amx.cpp).
constexpr int64_t VNNI_MIN_ROWS = 16;

// The 64 bytes _tile_loadconfig reads: palette 1, then per tile its bytes per row and its rows.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use AMX's int8 tiles: a CPU with them, the OS's permission, FASTDECODE_AMX not 0, and this
// build (the AVX-512 one) has them.
bool amx_int8_ready();

// Where M reaches tiled_min_rows(f) (amx.cpp): Y[:, :N / 32 * 32] = X @ W.T (+ bias) for X (M, K) float, W the
// format's packed tiles (tile_bytes per 4 weight rows), Y (M, N): bit for bit what the VNNI kernel gives for those
// columns, on AMX tiles where permitted, else with VNNI (AVX2: vpmaddubsw) over the tiles' layout. -> the columns it
// computed (0 for fewer rows), the rest left to the caller.
int64_t amx_linear(AmxFormat f, const float* X, int64_t M, int64_t K, const uint8_t* W, int64_t tile_bytes, int64_t N,
                   const float* bias, float* Y);

}  // namespace fastdecode
