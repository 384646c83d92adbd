/* tests/emu/fake/nccl.h: the part of NCCL's API that the KV transport's NCCL
 * payload (kvx/src/kvx_payload_nccl.c) calls, for the host emulation build
 * (tests/emu/nccl_emu.c implements it between two processes over a loopback
 * TCP connection). Found before the toolkit's nccl.h only by the emulation
 * targets. Plain C; the names, values and semantics are NCCL's. */
#ifndef CS_EMU_NCCL_H
#define CS_EMU_NCCL_H

#include <stddef.h>

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

typedef enum { ncclInt8 = 0, ncclUint8 = 1 } ncclDataType_t;

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef struct cs_emu_nccl_comm *ncclComm_t;

typedef struct {
    size_t size;
    unsigned int magic, version;
    int blocking;
    const char *commName;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER                                                                    \
    { sizeof(ncclConfig_t), 0xcafebeef, 0, 1, NULL }

const char *ncclGetErrorString(ncclResult_t r);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
