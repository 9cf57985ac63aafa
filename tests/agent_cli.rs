//! `cacheroute agent` without a GPU: it says which telemetry source it uses — none on a
//! machine without NVIDIA, `nvidia-smi` when one is on the PATH (a fake one here, the same
//! kind the SSH tests give their test host) — and streams JSON samples.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_cacheroute");

fn fake_smi_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("nvidia-smi");
    std::fs::write(
        &script,
        "#!/bin/sh\n# fake nvidia-smi: two H100s\necho '2026/11/30 08:00:00.000, 0, 87, 71234, 612.50, 1980, 63'\necho '2026/11/30 08:00:00.000, 1, 12, 1024, [N/A], 345, 31'\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

#[test]
fn without_any_gpu_it_says_so() {
    let empty = tempfile::tempdir().unwrap();
    let o = Command::new(BIN)
        .args(["agent", "--count", "1"])
        .env("PATH", empty.path())
        .output()
        .unwrap();
    assert!(o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.lines()
            .next()
            .unwrap_or("")
            .starts_with("telemetry source: none — NVML:"),
        "{err}"
    );
    assert!(o.stdout.is_empty());
    let o = Command::new(BIN)
        .args(["agent", "--count", "1", "--require-gpu"])
        .env("PATH", empty.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no GPU telemetry on this host"));
}

#[test]
fn with_nvidia_smi_it_streams_samples() {
    let dir = fake_smi_dir();
    let o = Command::new(BIN)
        .args(["agent", "--count", "2", "--interval-ms", "20"])
        .env("PATH", dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("telemetry source: nvidia-smi"));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "two GPUs, two rounds");
    assert_eq!(lines[0]["gpu"], 0);
    assert_eq!(lines[0]["power_w"], 612.5);
    assert_eq!(lines[1]["gpu"], 1);
    assert!(lines[1]["power_w"].is_null());
}
