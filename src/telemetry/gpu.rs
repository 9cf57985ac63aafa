//! GPU telemetry for `cacheroute agent`: NVML ([`super::nvml`], loaded at run time, so the
//! binary builds and runs without a GPU), else `nvidia-smi --query-gpu … -lms` (the
//! fallback over SSH), else none — and it always says which source it uses.
//!
//! A sample: per GPU, utilisation, memory used, power, cumulative energy, SM clock,
//! temperature and throttle reasons.

use serde::Serialize;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

/// One GPU at one moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuSample {
    /// Seconds since the Unix epoch.
    pub t: f64,
    pub gpu: u32,
    pub util_pct: Option<f64>,
    pub mem_used_mib: Option<f64>,
    pub power_w: Option<f64>,
    /// Energy since the driver loaded, joules (NVML only).
    pub energy_j: Option<f64>,
    pub sm_clock_mhz: Option<f64>,
    pub temp_c: Option<f64>,
    /// Throttle-reason bits as NVML reports them (NVML only).
    pub throttle_reasons: Option<u64>,
}

/// Where samples come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Source {
    Nvml { gpus: u32, driver: String },
    NvidiaSmi,
    None { why: String },
}

impl Source {
    /// One line for people.
    pub fn describe(&self) -> String {
        match self {
            Source::Nvml { gpus, driver } => {
                format!("telemetry source: NVML (driver {driver}), {gpus} GPU(s)")
            }
            Source::NvidiaSmi => {
                "telemetry source: nvidia-smi --query-gpu (NVML unavailable)".into()
            }
            Source::None { why } => format!("telemetry source: none — {why}"),
        }
    }
}

/// The fields `nvidia-smi` is asked for (docs/fleets.md), in order.
pub const SMI_QUERY: &str =
    "timestamp,index,utilization.gpu,memory.used,power.draw,clocks.sm,temperature.gpu";

/// Parse one `--format=csv,noheader,nounits` line of [`SMI_QUERY`]. Fields may be `[N/A]`.
pub fn parse_smi_line(line: &str, t: f64) -> Option<GpuSample> {
    let f: Vec<&str> = line.split(',').map(str::trim).collect();
    if f.len() != 7 {
        return None;
    }
    let num = |s: &str| s.parse::<f64>().ok();
    Some(GpuSample {
        t,
        gpu: f[1].parse().ok()?,
        util_pct: num(f[2]),
        mem_used_mib: num(f[3]),
        power_w: num(f[4]),
        energy_j: None,
        sm_clock_mhz: num(f[5]),
        temp_c: num(f[6]),
        throttle_reasons: None,
    })
}

/// A sampler bound to its source.
pub enum Sampler {
    Nvml(super::nvml::Nvml),
    Smi,
    None,
}

impl Sampler {
    /// NVML if it initialises, else `nvidia-smi` if it runs, else none (with the reasons).
    pub fn open() -> (Sampler, Source) {
        Self::open_with(super::nvml::Nvml::init())
    }

    /// [`Self::open`] given NVML's initialisation (a test loads another library).
    pub fn open_with(nvml: Result<super::nvml::Nvml, String>) -> (Sampler, Source) {
        let nvml_err = match nvml {
            Ok(n) => {
                let gpus = n.device_count().unwrap_or(0);
                let driver = n.driver_version().unwrap_or_else(|_| "unknown".into());
                return (Sampler::Nvml(n), Source::Nvml { gpus, driver });
            }
            Err(e) => e,
        };
        let smi = Command::new("nvidia-smi")
            .args(["--query-gpu", SMI_QUERY, "--format=csv,noheader,nounits"])
            .output();
        match smi {
            Ok(o) if o.status.success() => (Sampler::Smi, Source::NvidiaSmi),
            Ok(o) => (
                Sampler::None,
                Source::None {
                    why: format!(
                        "NVML: {nvml_err}; nvidia-smi exited {} ({})",
                        o.status,
                        String::from_utf8_lossy(&o.stderr).trim()
                    ),
                },
            ),
            Err(e) => (
                Sampler::None,
                Source::None {
                    why: format!("NVML: {nvml_err}; nvidia-smi: {e}"),
                },
            ),
        }
    }

    /// One sample of every GPU (NVML: direct; nvidia-smi: one invocation).
    pub fn sample(&self) -> Vec<GpuSample> {
        let t = crate::unix_now_s();
        match self {
            Sampler::Nvml(n) => {
                let count = n.device_count().unwrap_or(0);
                (0..count)
                    .filter_map(|i| n.read(i).ok().map(|r| (i, r)))
                    .map(|(i, r)| GpuSample {
                        t,
                        gpu: i,
                        util_pct: r.util_pct,
                        mem_used_mib: r.mem_used_bytes.map(|b| b / 1048576.0),
                        power_w: r.power_mw.map(|p| p / 1000.0),
                        energy_j: r.energy_mj.map(|e| e / 1000.0),
                        sm_clock_mhz: r.sm_clock_mhz,
                        temp_c: r.temp_c,
                        throttle_reasons: r.throttle_reasons,
                    })
                    .collect()
            }
            Sampler::Smi => Command::new("nvidia-smi")
                .args(["--query-gpu", SMI_QUERY, "--format=csv,noheader,nounits"])
                .stdout(Stdio::piped())
                .output()
                .map(|o| {
                    BufReader::new(&o.stdout[..])
                        .lines()
                        .map_while(Result::ok)
                        .filter_map(|l| parse_smi_line(&l, t))
                        .collect()
                })
                .unwrap_or_default(),
            Sampler::None => Vec::new(),
        }
    }
}

/// Sample every `interval` until `count` samples (None: forever), calling `emit` with each.
pub fn run(
    sampler: &Sampler,
    interval: Duration,
    count: Option<u64>,
    mut emit: impl FnMut(&GpuSample) -> bool,
) {
    let mut n = 0u64;
    loop {
        for s in sampler.sample() {
            if !emit(&s) {
                return;
            }
        }
        n += 1;
        if count.is_some_and(|c| n >= c) {
            return;
        }
        std::thread::sleep(interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smi_lines_parse_with_na_fields() {
        let s = parse_smi_line(
            "2026/11/30 08:00:00.123, 1, 87, 71234, 612.55, 1980, 63",
            5.0,
        )
        .unwrap();
        assert_eq!(
            (
                s.gpu,
                s.util_pct,
                s.mem_used_mib,
                s.power_w,
                s.sm_clock_mhz,
                s.temp_c
            ),
            (
                1,
                Some(87.0),
                Some(71234.0),
                Some(612.55),
                Some(1980.0),
                Some(63.0)
            )
        );
        let s = parse_smi_line("2026/11/30 08:00:00.123, 0, 5, 1024, [N/A], 345, 30", 0.0).unwrap();
        assert_eq!(s.power_w, None);
        assert!(parse_smi_line("garbage", 0.0).is_none());
    }

    #[test]
    fn the_source_is_always_named() {
        let (sampler, source) = Sampler::open();
        let d = source.describe();
        assert!(d.starts_with("telemetry source: "), "{d}");
        // Whatever the machine has, sampling never panics.
        let _ = sampler.sample();
    }
}
