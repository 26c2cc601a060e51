/* Which vector code the kernels were compiled with: the library is built with -march=native,
 * so the answer is this CPU's (or the -march that rein.kernels.cpu_native passed), and the
 * kernels' #if branches follow the same macros. For the load log and the tests. */

/* 2: AVX-512F (prefill tiles of 16 lanes) with AVX2+FMA; 1: AVX2+FMA; 0: portable C loops. */
int rein_instruction_set(void) {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
