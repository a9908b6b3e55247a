"""float32 ``exp`` and ``tanh`` for generated C kernels: branch-free, so a compiler vectorizes the loop.

glibc's scalar ``tanhf`` costs about 17 ns per element on this machine class against numpy's 0.45 ns, so a
fused kernel calling it loses to plain numpy; glibc's vector versions need ``-ffast-math``, which must never
reach the link (it would set flush-to-zero for the whole process). These are the other road: Cephes' ``expf``
reduction and polynomial (about 1 ULP), scaled by two exponent-bit multiplies so that results down to the
denormal range stay right, with every special case a select instead of a branch. ``tanh`` is
``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` (no overflow), and an odd Taylor polynomial below 0.1 where
that form would lose relative precision. NaN propagates; ``exp`` overflows to inf and underflows to 0.

float64 kernels keep libm: they are the reference path for gradient checks and must meet DESIGN.md's 1e-10.
"""
from __future__ import annotations

PRELUDE_F32 = r"""
#include <stdint.h>
#include <string.h>
static inline float mc_pow2i(int32_t n) {  /* 2^n for a normal exponent n */
    uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* a * b + c as one fused multiply-add where the target has one: the kernels compile as ISO C (-std=c99), where
   GCC contracts nothing, so exp's polynomial took twice the vector instructions it needs (the exp passes of
   the softmax cross-entropy kernels are compute-bound: 11% faster fused, still within 1 ULP). Without FMA
   hardware fmaf is a libm call, hence the plain form there. tanh keeps its plain form: fused, its rational
   form no longer rounds to exactly +-1 at the clamp. */
#ifdef __FMA__
#define MC_FMA(a, b, c) fmaf(a, b, c)
#else
#define MC_FMA(a, b, c) ((a) * (b) + (c))
#endif
static inline float mc_expf_core(float xc) {  /* e^xc for xc in [-103.97, 88.72] (clamped by the caller) */
    float fn = MC_FMA(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f;  /* round to nearest */
    float r = MC_FMA(fn, 2.12194440e-4f, MC_FMA(fn, -0.693359375f, xc));
    float z = r * r;
    float p = MC_FMA(1.9875691500e-4f, r, 1.3981999507e-3f);
    p = MC_FMA(p, r, 8.3334519073e-3f);
    p = MC_FMA(p, r, 4.1665795894e-2f);
    p = MC_FMA(p, r, 1.6666665459e-1f);
    p = MC_FMA(p, r, 5.0000001201e-1f);
    p = MC_FMA(p, z, r) + 1.0f;
    int32_t n = (int32_t)fn;
    int32_t n1 = n >> 1;
    return p * mc_pow2i(n1) * mc_pow2i(n - n1);
}
static inline float mc_expf(float x) {
    float xc = x > 88.72283935546875f ? 88.72283935546875f : x;
    xc = xc < -103.97208404541016f ? -103.97208404541016f : xc;
    float y = mc_expf_core(xc);
    y = x > 88.72283935546875f ? (float)INFINITY : y;
    y = x < -103.97208404541016f ? 0.0f : y;
    return x != x ? x : y;
}
/* e^x for x <= 0 or NaN, as a softmax's exp(x - max) is: no overflow to handle, and a NaN stays NaN through
   the arithmetic (every select is false for it). Five fewer vector instructions than mc_expf: the exp passes
   of the cross-entropy kernels (compute-bound) 17% faster. */
static inline float mc_expf_nonpos(float x) {
    float y = mc_expf_core(x < -103.97208404541016f ? -103.97208404541016f : x);
    return x < -103.97208404541016f ? 0.0f : y;
}
static inline float mc_tanhf(float x) {  /* odd/even rational minimax, as in Eigen's fast tanh */
    float xc = x > 7.90531110763549805f ? 7.90531110763549805f : x;
    xc = xc < -7.90531110763549805f ? -7.90531110763549805f : xc;
    float x2 = xc * xc;
    float p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
    p = x2 * p + -8.60467152213735e-11f;
    p = x2 * p + 5.12229709037114e-08f;
    p = x2 * p + 1.48572235717979e-05f;
    p = x2 * p + 6.37261928875436e-04f;
    p = x2 * p + 4.89352455891786e-03f;
    p = xc * p;
    float q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
    q = x2 * q + 2.26843463243900e-03f;
    q = x2 * q + 4.89352518554385e-03f;
    float t = p / q;
    t = fabsf(x) < 0.0004f ? x : t;
    return x != x ? x : t;
}
"""

FUNCS_F32 = {"exp": "mc_expf", "tanh": "mc_tanhf"}
