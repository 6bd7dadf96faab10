/*
 * The stub driver's memory that allocation hooks do not see (included by libcuda_stub.c; the
 * definitions are in stub_hidden.inc, included at its end): graphs with memory nodes (explicit,
 * stream capture, child graphs) whose memory the first launch or upload reserves, extra
 * contexts that each take STUB_CTX_MIB, context limits (malloc heap, printf FIFO, stack x 4096
 * resident threads) that take what they are raised by, and stubHidden(phys, mib): memory a
 * process gets without any allocation call (device malloc, a library's workspace).
 */
#ifndef STUB_HIDDEN_H
#define STUB_HIDDEN_H
static CUresult hidden_graph_create(void **g);
static CUresult hidden_graph_launch(void *exec);
static int hidden_graph_free(CUdeviceptr p);
static int hidden_capturing(CUstream s);
static void hidden_capture_abandon(void);
static unsigned long long hidden_capture_id(void);
CUresult cuStreamBeginCapture_v2(CUstream s, int mode);
static int hidden_capture_unsafe(CUstream s);
static CUresult hidden_capture_alloc(CUstream s, CUdeviceptr *p, size_t n);
static CUresult hidden_ctx_create(CUcontext *c, CUdevice d);
static CUresult kernel_launch_load(CUfunction f);
#endif
