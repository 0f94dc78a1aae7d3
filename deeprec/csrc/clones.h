// DEEPREC_CLONES: a function compiled once per ISA (AVX-512, AVX2, baseline), the best picked at load,
// so one wheel-less build runs at each CPU's width. GCC only (clang's target_clones differs).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DEEPREC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DEEPREC_CLONES
#endif
