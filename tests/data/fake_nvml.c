/* A stand-in for the driver's libnvidia-ml.so.1 with the entry points the GPU agent reads, each
 * with the C signature of NVIDIA's nvml.h: two GPUs with fixed readings, so tests/gpu_nvml.rs can
 * check the run-time loading, the struct layouts and the units end to end on a machine without
 * a GPU. Built by the test with `cc -shared -fPIC`. */
#include <string.h>

typedef unsigned int nvmlReturn_t;
typedef struct fake_device { unsigned int index; } *nvmlDevice_t;
typedef struct { unsigned int gpu; unsigned int memory; } nvmlUtilization_t;
/* nvmlMemory_v2_t: a version word (its size | 2 << 24), then bytes. */
typedef struct {
    unsigned int version;
    unsigned long long total; unsigned long long reserved;
    unsigned long long free; unsigned long long used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25

static struct fake_device devices[2] = {{0}, {1}};
static int initialised = 0;

/* Built with -DFAIL_INIT: a driver library whose initialisation fails (no device node, a
 * driver/library version mismatch). */
nvmlReturn_t nvmlInit_v2(void) {
#ifdef FAIL_INIT
    return NVML_ERROR_UNINITIALIZED;
#endif
    initialised = 1;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlShutdown(void) { initialised = 0; return NVML_SUCCESS; }
const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}
nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    strncpy(version, "550.54.15", length);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *count = 2;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index > 1) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    u->gpu = d->index == 0 ? 87 : 5;
    u->memory = 41;
    return NVML_SUCCESS;
}
/* A caller that does not set the v2 version word gets what the driver answers it. */
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    if (m->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = 143771ULL << 20;
    m->reserved = 512ULL << 20;
    m->used = (d->index == 0 ? 71234ULL : 1024ULL) << 20;
    m->free = m->total - m->reserved - m->used;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) {
    *mw = d->index == 0 ? 612550 : 75000;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *mj) {
    *mj = d->index == 0 ? 123456789ULL : 1000ULL;
    return NVML_SUCCESS;
}
/* NVML_CLOCK_SM is 1; GPU 1 does not report clocks. */
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, unsigned int type, unsigned int *mhz) {
    if (type != 1) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->index == 1) return NVML_ERROR_NOT_SUPPORTED;
    *mhz = 1980;
    return NVML_SUCCESS;
}
/* NVML_TEMPERATURE_GPU is 0. */
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, unsigned int sensor, unsigned int *c) {
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *c = d->index == 0 ? 63 : 30;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) {
    *r = d->index == 0 ? 0x4ULL : 0x1ULL;
    return NVML_SUCCESS;
}
