//! NVML through the `nvml-wrapper` crate, which loads the driver's `libnvidia-ml.so.1` at run
//! time (so the binary builds and runs where there is no GPU). A missing library, one without
//! an entry point the GPU agent reads, or an `nvmlInit` failure is an error naming it; a query
//! a device does not support leaves that field empty.

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use std::ffi::OsStr;

/// Where the driver installs it.
pub const LIBRARY: &str = "libnvidia-ml.so.1";

/// An initialised NVML; shut down and unloaded when dropped.
pub struct Nvml {
    /// Boxed: the crate's handle holds every entry point (about 12 KB).
    nvml: Box<nvml_wrapper::Nvml>,
    path: String,
}

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

/// A query's value, or why the library cannot answer it at all (an entry point it lacks).
/// Any other failure (not supported by this device, GPU lost, …) is an empty field.
fn field<T>(path: &str, r: Result<T, NvmlError>) -> Result<Option<T>, String> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(NvmlError::FailedToLoadSymbol(why)) => Err(format!("{path}: {why}")),
        Err(_) => Ok(None),
    }
}

impl Nvml {
    /// Load [`LIBRARY`] and initialise it.
    pub fn init() -> Result<Nvml, String> {
        Self::init_at(LIBRARY)
    }

    /// Load the library at `path` (a name the dynamic loader resolves, or a file) and
    /// initialise it. The library must have every entry point [`Nvml::read`] uses (checked on
    /// the first GPU, where there is one) and the energy and throttle queries may be absent
    /// (drivers older than Volta's).
    pub fn init_at(path: &str) -> Result<Nvml, String> {
        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(OsStr::new(path))
            .init()
            .map_err(|e| match e {
                NvmlError::LibloadingError(e) => crate::error_chain(&e),
                NvmlError::FailedToLoadSymbol(why) => format!("{path}: {why}"),
                e => format!("nvmlInit_v2: {e}"),
            })?;
        let n = Nvml {
            nvml: Box::new(nvml),
            path: path.to_string(),
        };
        if n.device_count()? > 0 {
            n.read_checked(0)?;
        }
        Ok(n)
    }

    /// Number of GPUs.
    pub fn device_count(&self) -> Result<u32, String> {
        self.nvml.device_count().map_err(|e| e.to_string())
    }

    /// The driver's version string.
    pub fn driver_version(&self) -> Result<String, String> {
        self.nvml.sys_driver_version().map_err(|e| e.to_string())
    }

    /// One reading of GPU `index`.
    pub fn read(&self, index: u32) -> Result<Reading, String> {
        self.read_checked(index)
    }

    /// One reading, or an error when the library lacks an entry point a field needs (other
    /// than the energy and throttle queries, which older drivers lack).
    fn read_checked(&self, index: u32) -> Result<Reading, String> {
        let p = self.path.as_str();
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(|e| e.to_string())?;
        Ok(Reading {
            util_pct: field(p, d.utilization_rates())?.map(|u| u.gpu as f64),
            mem_used_bytes: field(p, d.memory_info())?.map(|m| m.used as f64),
            power_mw: field(p, d.power_usage())?.map(|w| w as f64),
            energy_mj: field(p, d.total_energy_consumption())
                .unwrap_or(None)
                .map(|e| e as f64),
            sm_clock_mhz: field(p, d.clock_info(Clock::SM))?.map(|c| c as f64),
            temp_c: field(p, d.temperature(TemperatureSensor::Gpu))?.map(|t| t as f64),
            throttle_reasons: field(p, d.current_throttle_reasons())
                .unwrap_or(None)
                .map(|r| r.bits()),
        })
    }
}
