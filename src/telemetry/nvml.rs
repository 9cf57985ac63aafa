//! NVML, loaded at run time: `dlopen` of the driver's `libnvidia-ml.so.1` (so the binary builds
//! and runs where there is no GPU) and the dozen entry points the GPU agent reads, declared as
//! in NVIDIA's `nvml.h`. A missing library or an `nvmlInit` failure is an error naming it; a
//! query a device does not support leaves that field empty.

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString};

/// `nvmlReturn_t`: 0 is `NVML_SUCCESS`.
type Ret = c_uint;
/// `nvmlDevice_t`: an opaque handle.
type Device = *mut c_void;

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `nvmlMemory_t` (v1): bytes.
#[repr(C)]
#[derive(Default)]
struct Memory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// `NVML_CLOCK_SM` of `nvmlClockType_t`.
const CLOCK_SM: c_uint = 1;
/// `NVML_TEMPERATURE_GPU` of `nvmlTemperatureSensors_t`.
const TEMPERATURE_GPU: c_uint = 0;
/// `NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE`.
const DRIVER_VERSION_LEN: usize = 80;

/// Where the driver installs it.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

struct Fns {
    init: unsafe extern "C" fn() -> Ret,
    shutdown: unsafe extern "C" fn() -> Ret,
    error_string: unsafe extern "C" fn(Ret) -> *const c_char,
    driver_version: unsafe extern "C" fn(*mut c_char, c_uint) -> Ret,
    count: unsafe extern "C" fn(*mut c_uint) -> Ret,
    handle: unsafe extern "C" fn(c_uint, *mut Device) -> Ret,
    utilization: unsafe extern "C" fn(Device, *mut Utilization) -> Ret,
    memory: unsafe extern "C" fn(Device, *mut Memory) -> Ret,
    power: unsafe extern "C" fn(Device, *mut c_uint) -> Ret,
    clock: unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> Ret,
    temperature: unsafe extern "C" fn(Device, c_uint, *mut c_uint) -> Ret,
    /// Newer than the rest (Volta); absent from old drivers.
    energy: Option<unsafe extern "C" fn(Device, *mut c_ulonglong) -> Ret>,
    throttle: Option<unsafe extern "C" fn(Device, *mut c_ulonglong) -> Ret>,
}

/// An initialised NVML; shut down and unloaded when dropped.
pub struct Nvml {
    lib: *mut c_void,
    f: Fns,
}

// SAFETY: NVML's entry points are thread-safe (nvml.h); the handle is only used through them.
unsafe impl Send for Nvml {}

/// One device's reading; `None` where the device does not support the query.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Reading {
    pub util_pct: Option<f64>,
    pub mem_used_bytes: Option<f64>,
    pub power_mw: Option<f64>,
    pub energy_mj: Option<f64>,
    pub sm_clock_mhz: Option<f64>,
    pub temp_c: Option<f64>,
    pub throttle_reasons: Option<u64>,
}

/// The function at `p` as the function-pointer type `F`.
///
/// # Safety
/// `F` must be the C signature of the function at `p`.
unsafe fn fn_at<F>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked); the caller vouches for the signature.
    unsafe { std::mem::transmute_copy(&p) }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: not null, so NUL-terminated and valid until the next dl call.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl Nvml {
    /// Load [`LIBRARY`] and initialise it.
    pub fn init() -> Result<Nvml, String> {
        Self::init_at(LIBRARY)
    }

    /// Load the library at `path` (a name the dynamic loader resolves, or a file) and
    /// initialise it.
    pub fn init_at(path: &str) -> Result<Nvml, String> {
        let c = CString::new(path).map_err(|_| format!("{path}: not a library path"))?;
        // SAFETY: a NUL-terminated path; the flags are plain constants.
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err(dl_error());
        }
        let sym = |name: &str| -> Result<*mut c_void, String> {
            let n = CString::new(name).expect("symbol name");
            // SAFETY: `lib` is a live handle; `n` is NUL-terminated.
            let p = unsafe { libc::dlsym(lib, n.as_ptr()) };
            if p.is_null() {
                Err(format!("{path} has no `{name}`"))
            } else {
                Ok(p)
            }
        };
        let f = (|| -> Result<Fns, String> {
            // SAFETY: for every transmute, the symbol is NVML's function of that name, whose C
            // signature (nvml.h) is the type it is given here.
            unsafe {
                Ok(Fns {
                    init: fn_at(sym("nvmlInit_v2")?),
                    shutdown: fn_at(sym("nvmlShutdown")?),
                    error_string: fn_at(sym("nvmlErrorString")?),
                    driver_version: fn_at(sym("nvmlSystemGetDriverVersion")?),
                    count: fn_at(sym("nvmlDeviceGetCount_v2")?),
                    handle: fn_at(sym("nvmlDeviceGetHandleByIndex_v2")?),
                    utilization: fn_at(sym("nvmlDeviceGetUtilizationRates")?),
                    memory: fn_at(sym("nvmlDeviceGetMemoryInfo")?),
                    power: fn_at(sym("nvmlDeviceGetPowerUsage")?),
                    clock: fn_at(sym("nvmlDeviceGetClockInfo")?),
                    temperature: fn_at(sym("nvmlDeviceGetTemperature")?),
                    energy: sym("nvmlDeviceGetTotalEnergyConsumption")
                        .ok()
                        .map(|p| fn_at(p)),
                    throttle: sym("nvmlDeviceGetCurrentClocksThrottleReasons")
                        .ok()
                        .map(|p| fn_at(p)),
                })
            }
        })();
        let f = match f {
            Ok(f) => f,
            Err(e) => {
                // SAFETY: the handle dlopen returned, closed once.
                unsafe { libc::dlclose(lib) };
                return Err(e);
            }
        };
        // SAFETY: NVML's init takes no arguments.
        let r = unsafe { (f.init)() };
        let n = Nvml { lib, f };
        if r != 0 {
            let why = n.error(r);
            // Not initialised: unload without nvmlShutdown.
            let lib = n.lib;
            std::mem::forget(n);
            // SAFETY: as above.
            unsafe { libc::dlclose(lib) };
            return Err(format!("nvmlInit_v2: {why}"));
        }
        Ok(n)
    }

    /// NVML's text for a return code.
    fn error(&self, r: Ret) -> String {
        // SAFETY: nvmlErrorString returns a static NUL-terminated string (or null).
        let p = unsafe { (self.f.error_string)(r) };
        if p.is_null() {
            format!("NVML error {r}")
        } else {
            // SAFETY: not null, so a static NUL-terminated string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// Number of GPUs.
    pub fn device_count(&self) -> Result<u32, String> {
        let mut n: c_uint = 0;
        // SAFETY: a valid out-pointer.
        match unsafe { (self.f.count)(&mut n) } {
            0 => Ok(n),
            r => Err(self.error(r)),
        }
    }

    /// The driver's version string.
    pub fn driver_version(&self) -> Result<String, String> {
        let mut buf = [0 as c_char; DRIVER_VERSION_LEN];
        // SAFETY: the buffer and its length.
        match unsafe { (self.f.driver_version)(buf.as_mut_ptr(), buf.len() as c_uint) } {
            0 => {
                buf[DRIVER_VERSION_LEN - 1] = 0;
                // SAFETY: the buffer ends in a NUL written just above.
                Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
                    .to_string_lossy()
                    .into_owned())
            }
            r => Err(self.error(r)),
        }
    }

    /// One reading of GPU `index`.
    pub fn read(&self, index: u32) -> Result<Reading, String> {
        let mut d: Device = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let r = unsafe { (self.f.handle)(index as c_uint, &mut d) };
        if r != 0 {
            return Err(self.error(r));
        }
        // SAFETY: for every call, `d` is the handle NVML gave; the out-pointers are valid. Each
        // value is read after its call returned success.
        unsafe {
            let mut u = Utilization::default();
            let ok = (self.f.utilization)(d, &mut u) == 0;
            let util = ok.then_some(u.gpu as f64);
            let mut m = Memory::default();
            let ok = (self.f.memory)(d, &mut m) == 0;
            let mem = ok.then_some(m.used as f64);
            let mut p: c_uint = 0;
            let ok = (self.f.power)(d, &mut p) == 0;
            let power = ok.then_some(p as f64);
            let mut c: c_uint = 0;
            let ok = (self.f.clock)(d, CLOCK_SM, &mut c) == 0;
            let clock = ok.then_some(c as f64);
            let mut t: c_uint = 0;
            let ok = (self.f.temperature)(d, TEMPERATURE_GPU, &mut t) == 0;
            let temp = ok.then_some(t as f64);
            let mut e: c_ulonglong = 0;
            let ok = self.f.energy.is_some_and(|f| f(d, &mut e) == 0);
            let energy = ok.then_some(e as f64);
            let mut th: c_ulonglong = 0;
            let ok = self.f.throttle.is_some_and(|f| f(d, &mut th) == 0);
            let throttle = ok.then_some(th);
            Ok(Reading {
                util_pct: util,
                mem_used_bytes: mem,
                power_mw: power,
                energy_mj: energy,
                sm_clock_mhz: clock,
                temp_c: temp,
                throttle_reasons: throttle,
            })
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: initialised in `init_at`; shut down and unloaded once.
        unsafe {
            (self.f.shutdown)();
            let _: c_int = libc::dlclose(self.lib);
        }
    }
}
