//! Engine launch commands for vLLM and SGLang, built from a study's fleet spec and a replica's
//! placement: model checkpoint, tensor parallelism, precision (pre-quantized fp8 checkpoints,
//! online fp8 quantization, fp8 KV cache, fp16/bf16), port, `CUDA_VISIBLE_DEVICES`, prefix
//! caching, metrics and cached-token reporting (design.md §8). Also the remote shell line that
//! starts one in its own session with a PID file and a log. Pure string building.

use super::inventory::{EngineRuntime, Placement};
use crate::experiment::spec::{EngineKind, Fleet};
use std::path::Path;

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

/// The engine's argument vector (after the Python interpreter), for one replica.
pub fn engine_args(fleet: &Fleet, placement: &Placement) -> Vec<String> {
    let ckpt = fleet
        .checkpoint
        .clone()
        .unwrap_or_else(|| default_checkpoint(&fleet.model, &fleet.precision));
    let port = placement.port.to_string();
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
            // The two servers take the same settings under different flag names.
            let vllm = fleet.engine == EngineKind::Vllm;
            let (module, model_flag, tp_flag, fp8_kv) = if vllm {
                (
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    "--tensor-parallel-size",
                    "fp8",
                )
            } else {
                ("sglang.launch_server", "--model-path", "--tp", "fp8_e5m2")
            };
            let mut a = vec![
                s("-m"),
                s(module),
                s(model_flag),
                ckpt.clone(),
                s("--served-model-name"),
                s(SERVED_MODEL_NAME),
                s("--host"),
                s("0.0.0.0"),
                s("--port"),
                port,
                s(tp_flag),
                tp,
            ];
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
            if vllm {
                a.extend([
                    s("--enable-prefix-caching"),
                    s("--enable-prompt-tokens-details"),
                    s("--disable-uvicorn-access-log"),
                ]);
            } else {
                a.extend([s("--enable-metrics"), s("--enable-cache-report")]);
            }
            a
        }
    }
}

/// Environment of a replica.
pub fn engine_env(fleet: &Fleet, placement: &Placement) -> Vec<(String, String)> {
    let gpus = placement
        .gpus
        .iter()
        .map(|g| g.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut env = vec![("CUDA_VISIBLE_DEVICES".to_string(), gpus)];
    if fleet.engine == EngineKind::Vllm {
        env.push(("VLLM_NO_USAGE_STATS".into(), "1".into()));
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
pub fn command_line(fleet: &Fleet, placement: &Placement, rt: &EngineRuntime) -> String {
    let env = engine_env(fleet, placement)
        .iter()
        .map(|(k, v)| format!("{k}={}", sh_quote(v)))
        .collect::<Vec<_>>()
        .join(" ");
    let args = engine_args(fleet, placement)
        .iter()
        .map(|a| sh_quote(a))
        .collect::<Vec<_>>()
        .join(" ");
    format!("{env} {} {args}", program(fleet, rt))
}

/// The program an engine runs under: Python for vLLM and SGLang, the `cacheroute` binary on
/// the host's PATH for the emulator.
fn program(fleet: &Fleet, rt: &EngineRuntime) -> String {
    match fleet.engine {
        EngineKind::Emulator => "cacheroute".into(),
        _ => python_prefix(rt),
    }
}

/// The remote line that starts a replica in a new session (so it outlives the SSH connection
/// and its whole process group can be killed), logging to `<scratch>/replica-<i>.log` and
/// writing its PID (= process group id) to `<scratch>/replica-<i>.pid`.
pub fn start_line(
    fleet: &Fleet,
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
            engine_args(fleet, placement).iter().map(|a| sh_quote(a)).collect::<Vec<_>>().join(" ")
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
    use crate::experiment::spec::KnobOverridesSpec;

    fn fleet(engine: EngineKind, precision: &str) -> Fleet {
        Fleet {
            engine,
            model: "llama-3.3-70b".into(),
            gpu: "h100".into(),
            precision: precision.into(),
            tp: 2,
            replicas: 30,
            inventory: None,
            checkpoint: None,
            knobs: KnobOverridesSpec::default(),
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
            "CUDA_VISIBLE_DEVICES=6,7 VLLM_NO_USAGE_STATS=1 /opt/vllm/.venv/bin/python -m vllm.entrypoints.openai.api_server \
--model nvidia/Llama-3.3-70B-Instruct-FP8 --served-model-name cacheroute-model --host 0.0.0.0 --port 8103 \
--tensor-parallel-size 2 --kv-cache-dtype fp8 --enable-prefix-caching --enable-prompt-tokens-details --disable-uvicorn-access-log"
        );
    }

    #[test]
    fn golden_vllm_fp16_flagship() {
        let rt = EngineRuntime::Venv(VENV.into());
        assert_eq!(
            command_line(&fleet(EngineKind::Vllm, "fp16"), &replica3(), &rt),
            "CUDA_VISIBLE_DEVICES=6,7 VLLM_NO_USAGE_STATS=1 /opt/vllm/.venv/bin/python -m vllm.entrypoints.openai.api_server \
--model meta-llama/Llama-3.3-70B-Instruct --served-model-name cacheroute-model --host 0.0.0.0 --port 8103 \
--tensor-parallel-size 2 --dtype float16 --enable-prefix-caching --enable-prompt-tokens-details --disable-uvicorn-access-log"
        );
    }

    #[test]
    fn golden_sglang_fp8_and_fp16_flagship() {
        let rt = EngineRuntime::Path;
        assert_eq!(
            command_line(&fleet(EngineKind::Sglang, "fp8"), &replica3(), &rt),
            "CUDA_VISIBLE_DEVICES=6,7 python3 -m sglang.launch_server --model-path nvidia/Llama-3.3-70B-Instruct-FP8 \
--served-model-name cacheroute-model --host 0.0.0.0 --port 8103 --tp 2 --kv-cache-dtype fp8_e5m2 --enable-metrics --enable-cache-report"
        );
        assert_eq!(
            command_line(&fleet(EngineKind::Sglang, "fp16"), &replica3(), &rt),
            "CUDA_VISIBLE_DEVICES=6,7 python3 -m sglang.launch_server --model-path meta-llama/Llama-3.3-70B-Instruct \
--served-model-name cacheroute-model --host 0.0.0.0 --port 8103 --tp 2 --dtype float16 --enable-metrics --enable-cache-report"
        );
    }

    #[test]
    fn online_fp8_quantizes_an_fp16_checkpoint() {
        let mut f = fleet(EngineKind::Vllm, "fp8");
        f.checkpoint = Some("/models/Llama-3.3-70B-Instruct".into());
        let a = engine_args(&f, &replica3()).join(" ");
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
        assert!(l.starts_with("mkdir -p /scratch/cr && cd /scratch/cr && { CUDA_VISIBLE_DEVICES=6,7 VLLM_NO_USAGE_STATS=1 setsid conda run --no-capture-output -n 'vllm env' python -m vllm"), "{l}");
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
