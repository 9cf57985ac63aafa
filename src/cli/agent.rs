//! `cacheroute agent`: GPU telemetry on a host, one JSON sample per line on stdout (the runner
//! starts it over SSH and stores what it streams back). The first line on stderr names the
//! source: NVML, nvidia-smi, or none and why.

use crate::telemetry::gpu::{self, Sampler, Source};
use std::io::Write;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  cacheroute agent --count 1              # one sample of every GPU, then exit
  cacheroute agent --interval-ms 250      # stream until stdout closes or Ctrl-C")]
pub struct AgentArgs {
    /// Sampling interval in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub interval_ms: u64,
    /// Stop after this many rounds (default: until stdout closes or Ctrl-C).
    #[arg(long)]
    pub count: Option<u64>,
    /// Fail (exit 2) when no GPU telemetry source is available, instead of idling.
    #[arg(long)]
    pub require_gpu: bool,
}

pub fn run(a: AgentArgs) -> anyhow::Result<()> {
    let (sampler, source) = Sampler::open();
    eprintln!("{}", source.describe());
    if let Source::None { why } = &source {
        if a.require_gpu {
            anyhow::bail!("no GPU telemetry on this host: {why}; install the NVIDIA driver or put nvidia-smi on the PATH");
        }
    }
    exit_when_stdout_closes();
    let out = std::io::stdout();
    let mut out = out.lock();
    gpu::run(
        &sampler,
        std::time::Duration::from_millis(a.interval_ms.max(10)),
        a.count,
        |s| {
            serde_json::to_writer(&mut out, s).is_ok()
                && writeln!(out).is_ok()
                && out.flush().is_ok()
        },
    );
    Ok(())
}

/// Exit when the reader of stdout has gone (the runner's SSH channel closed), also while
/// nothing is written: a host without GPU telemetry writes no sample, so no failed write would
/// ever tell, and the agent would outlive its study.
fn exit_when_stdout_closes() {
    std::thread::spawn(|| loop {
        let mut p = libc::pollfd {
            fd: libc::STDOUT_FILENO,
            events: 0,
            revents: 0,
        };
        // SAFETY: polling one descriptor of our own, with a valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, 1000) };
        if n > 0 && p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            std::process::exit(0);
        }
        if n < 0 {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    });
}
