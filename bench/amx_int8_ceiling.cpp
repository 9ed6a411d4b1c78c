// amx_int8_ceiling.cpp — the in-cache rate of AMX-INT8 `tdpbssd` on this machine: the ceiling of the exact
// linear's AMX path (docs/exact_linear.md, "Cost"). Torch-free, standalone:
//     g++ -O2 -mamx-tile -mamx-int8 bench/amx_int8_ceiling.cpp -o /tmp/amx_ceiling && /tmp/amx_ceiling
// Modes: 4 independent 16x16 int32 C tiles with no loads; with 2 or 4 tile loads (L1-resident) per 4 products
// (the exact kernel's 2x2 digit blocks need 4); one dependent chain; 4 loads into 3 level-merged C tiles (the
// exact kernel's inner loop). Reports int8 GMAC/s of the calling thread's CPU time.
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) Cfg { uint8_t palette, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double ct() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
alignas(64) int8_t A[2][16 * 64], B[2][16 * 64]; alignas(64) int32_t C[16*16];
__attribute__((target("amx-tile,amx-int8"))) int main() {
  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: Linux grants the tile state on request only
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    printf("AMX tile state not granted\n");
    return 1;
  }
  Cfg c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.colsb[i] = 64; c.rows[i] = 16; }
  _tile_loadconfig(&c);
  const long n = 2000000;
  for (int mode = 0; mode < 5; ++mode) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, A[0], 64); _tile_loadd(5, A[1], 64); _tile_loadd(6, B[0], 64); _tile_loadd(7, B[1], 64);
    double t0 = ct();
    for (long i = 0; i < n; ++i) {
      if (mode == 1) { _tile_loadd(4, A[0], 64); _tile_loadd(6, B[0], 64); }
      if (mode == 2) { _tile_loadd(4, A[0], 64); _tile_loadd(5, A[1], 64); _tile_loadd(6, B[0], 64); _tile_loadd(7, B[1], 64); }
      if (mode == 3) { _tile_dpbssd(0, 4, 6); _tile_dpbssd(0, 4, 7); _tile_dpbssd(0, 5, 6); _tile_dpbssd(0, 5, 7); }
      else if (mode == 4) { _tile_loadd(4, A[0], 64); _tile_loadd(5, A[1], 64); _tile_loadd(6, B[0], 64); _tile_loadd(7, B[1], 64); _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 7); _tile_dpbssd(1, 5, 6); }
      else { _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7); }
    }
    _tile_stored(0, C, 64);
    double t = ct() - t0;
    printf("mode %d (%s): %.1f GMAC/s, %.2f ns per tdpbssd\n", mode, mode==0?"no loads":mode==1?"2 loads/4 dp":mode==2?"4 loads/4 dp":mode==3?"1 chain":"4 loads, 3 C (level merged)", 4.0 * n * 16384 / t / 1e9, t / (4.0 * n) * 1e9);
  }
  _tile_release();
}
