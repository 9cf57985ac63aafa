//! The GPU agent's NVML path (src/telemetry/nvml.rs) against a library with NVML's C entry
//! points (tests/data/fake_nvml.c, built here with `cc`): loading at run time, the struct
//! layouts and the units of every field, a query a GPU does not support, and the errors when
//! the library is missing or lacks an entry point. A real driver needs a GPU machine; this is
//! what runs everywhere.

use cacheroute::telemetry::gpu::{Sampler, Source};
use cacheroute::telemetry::nvml::Nvml;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Build the C file `name` (tests/data) into a shared library in `dir`.
fn build(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fake_nvml.c");
    let out = dir.join(format!("{name}.so"));
    let o = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .args(extra)
        .arg(&src)
        .output()
        .expect("run cc (a C compiler, as SQLite's build needs)");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

#[test]
fn readings_come_through_with_nvml_layouts_and_units() {
    let dir = tempfile::tempdir().unwrap();
    let lib = build(dir.path(), "libnvml-fake", &[]);
    let (sampler, source) = Sampler::open_with(Nvml::init_at(lib.to_str().unwrap()));
    assert_eq!(
        source,
        Source::Nvml {
            gpus: 2,
            driver: "550.54.15".into()
        }
    );
    let s = sampler.sample();
    assert_eq!(s.len(), 2);
    let g0 = &s[0];
    assert_eq!(g0.gpu, 0);
    assert_eq!(g0.util_pct, Some(87.0));
    assert_eq!(g0.mem_used_mib, Some(71234.0));
    assert_eq!(g0.power_w, Some(612.55));
    assert_eq!(g0.energy_j, Some(123456.789));
    assert_eq!(g0.sm_clock_mhz, Some(1980.0));
    assert_eq!(g0.temp_c, Some(63.0));
    assert_eq!(g0.throttle_reasons, Some(4));
    // GPU 1 does not report its clock: that field alone is empty.
    let g1 = &s[1];
    assert_eq!((g1.gpu, g1.util_pct, g1.sm_clock_mhz), (1, Some(5.0), None));
    assert_eq!(g1.mem_used_mib, Some(1024.0));
}

#[test]
fn a_missing_library_or_entry_point_is_an_error_naming_it() {
    let e = Nvml::init_at("/nonexistent/libnvidia-ml.so.1")
        .err()
        .unwrap();
    assert!(e.contains("/nonexistent/libnvidia-ml.so.1"), "{e}");
    // The fallback chain says why NVML was not used.
    let (_, source) = Sampler::open_with(Err(e));
    let d = source.describe();
    assert!(d.contains("nvidia-smi") || d.contains("NVML"), "{d}");
    // A library without nvmlDeviceGetMemoryInfo_v2 (renamed away by the preprocessor) is
    // refused at start, naming the library and the entry point.
    let dir = tempfile::tempdir().unwrap();
    let lib = build(
        dir.path(),
        "libnvml-partial",
        &["-DnvmlDeviceGetMemoryInfo_v2=not_nvml_memory"],
    );
    let e = Nvml::init_at(lib.to_str().unwrap()).err().unwrap();
    assert!(
        e.contains("nvmlDeviceGetMemoryInfo_v2") && e.contains("libnvml-partial"),
        "{e}"
    );
    // One without the energy query (drivers older than Volta's): that field alone is empty.
    let lib = build(
        dir.path(),
        "libnvml-old",
        &["-DnvmlDeviceGetTotalEnergyConsumption=not_nvml_energy"],
    );
    let old = Nvml::init_at(lib.to_str().unwrap()).unwrap();
    let r = old.read(0).unwrap();
    assert_eq!((r.energy_mj, r.util_pct), (None, Some(87.0)));
    drop(old);
    // A library that loads but whose nvmlInit fails: the error says so with NVML's own text,
    // and the sampler falls back (never a sampler on an uninitialised NVML).
    let lib = build(dir.path(), "libnvml-noinit", &["-DFAIL_INIT"]);
    let e = Nvml::init_at(lib.to_str().unwrap()).err().unwrap();
    assert!(
        e.starts_with("nvmlInit_v2: ") && e.contains("initialized"),
        "{e}"
    );
    let (sampler, source) = Sampler::open_with(Err(e));
    assert!(!matches!(source, Source::Nvml { .. }), "{source:?}");
    assert!(source.describe().contains("nvmlInit_v2: ") || matches!(source, Source::NvidiaSmi));
    let _ = sampler.sample();
}
