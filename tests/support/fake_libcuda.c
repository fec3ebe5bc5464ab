/* CPU-only test stand-in for libcuda.so.1, for kvikio host-memory I/O in CI (shared/notes/environment.md §3).
   Every driver call answers CUDA_ERROR_NOT_INITIALIZED (3); kvikio then treats each buffer as host memory
   and uses its POSIX path. Never use on a GPU machine. */
#define NOT_INITIALIZED 3
#define STUB(name) int name(void) { return NOT_INITIALIZED; }
int cuDriverGetVersion(int *v) { *v = 12000; return 0; }   /* < 12.8: skip cuMemcpyBatchAsync */
int cuDeviceGetCount(int *n) { *n = 0; return 0; }
int cuGetErrorName(int e, const char **s) { (void)e; *s = "CUDA_ERROR_NOT_INITIALIZED"; return 0; }
int cuGetErrorString(int e, const char **s) { (void)e; *s = "no CUDA driver (test stub)"; return 0; }
STUB(cuInit) STUB(cuMemHostAlloc) STUB(cuMemFreeHost) STUB(cuMemHostRegister_v2) STUB(cuMemHostUnregister)
STUB(cuMemcpyHtoDAsync_v2) STUB(cuMemcpyDtoHAsync_v2) STUB(cuMemcpyAsync) STUB(cuMemcpyBatchAsync)
STUB(cuMemcpyBatchAsync_v2) STUB(cuPointerGetAttribute) STUB(cuPointerGetAttributes)
STUB(cuMemGetAddressRange_v2) STUB(cuCtxPushCurrent_v2) STUB(cuCtxPopCurrent_v2) STUB(cuCtxGetCurrent)
STUB(cuCtxGetDevice) STUB(cuCtxCreate_v4) STUB(cuCtxDestroy_v2) STUB(cuDeviceGet) STUB(cuDeviceGetAttribute)
STUB(cuDevicePrimaryCtxRetain) STUB(cuDevicePrimaryCtxRelease_v2) STUB(cuStreamSynchronize)
STUB(cuStreamCreate) STUB(cuStreamDestroy_v2) STUB(cuEventCreate) STUB(cuEventDestroy_v2)
STUB(cuEventRecord) STUB(cuEventQuery) STUB(cuEventSynchronize) STUB(cuLaunchHostFunc)
