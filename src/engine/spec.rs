//! `EngineSpec`: the one-line name of an engine configuration, `model:device:precision:tpN`
//! (optionally `:kv-<precision>`), parsed with errors that name the bad part and list the valid
//! choices. Pure; (de)serializes as that string so experiment YAML can say
//! `engine: llama-3.3-70b:h100:fp8:tp2`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::cards::{DeviceCard, ModelCard, Precision};
use super::EngineError;

/// A model on a device at a precision and tensor-parallel degree.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct EngineSpec {
    /// Model preset name (see [`ModelCard::PRESETS`]).
    pub model: String,
    /// Device preset name (see [`DeviceCard::NAMES`]).
    pub device: String,
    /// Weight precision.
    pub weights: Precision,
    /// KV-cache precision (defaults to the weight precision).
    pub kv: Precision,
    /// Tensor-parallel degree (devices per replica).
    pub tp: u32,
}

fn precision_names() -> String {
    Precision::ALL.map(|p| p.name()).join(", ")
}

impl EngineSpec {
    /// Look up the model card.
    pub fn model_card(&self) -> &'static ModelCard {
        ModelCard::preset(&self.model).expect("EngineSpec holds a validated model name")
    }

    /// Look up the device card (GPU presets carry the calibrated efficiency factors).
    pub fn device_card(&self) -> DeviceCard {
        DeviceCard::preset(&self.device).expect("EngineSpec holds a validated device name")
    }
}

impl FromStr for EngineSpec {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |part: &str, value: &str, valid: String| EngineError::BadSpec {
            spec: s.to_string(),
            part: part.to_string(),
            value: value.to_string(),
            valid,
        };
        let parts: Vec<&str> = s.trim().split(':').collect();
        if !(parts.len() == 4 || parts.len() == 5) {
            return Err(EngineError::SpecShape {
                spec: s.to_string(),
                parts: parts.len(),
            });
        }
        let model = ModelCard::preset(parts[0])
            .ok_or_else(|| bad("model", parts[0], ModelCard::preset_names()))?;
        let device = DeviceCard::preset(parts[1])
            .ok_or_else(|| bad("device", parts[1], DeviceCard::preset_names()))?;
        let weights = Precision::parse(parts[2])
            .ok_or_else(|| bad("precision", parts[2], precision_names()))?;
        let tp = parts[3]
            .strip_prefix("tp")
            .or_else(|| parts[3].strip_prefix("TP"))
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|&n| (1..=64).contains(&n))
            .ok_or_else(|| bad("tensor parallel", parts[3], "tp1 … tp64 (e.g. tp2)".into()))?;
        let kv = match parts.get(4) {
            None => weights,
            Some(p) => p
                .strip_prefix("kv-")
                .and_then(Precision::parse)
                .ok_or_else(|| {
                    bad(
                        "kv precision",
                        p,
                        Precision::ALL
                            .map(|p| format!("kv-{}", p.name()))
                            .join(", "),
                    )
                })?,
        };
        Ok(EngineSpec {
            model: model.name.to_string(),
            device: device.name.to_string(),
            weights,
            kv,
            tp,
        })
    }
}

impl fmt::Display for EngineSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}:tp{}",
            self.model,
            self.device,
            self.weights.name(),
            self.tp
        )?;
        if self.kv != self.weights {
            write!(f, ":kv-{}", self.kv.name())?;
        }
        Ok(())
    }
}

impl TryFrom<String> for EngineSpec {
    type Error = EngineError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<EngineSpec> for String {
    fn from(s: EngineSpec) -> String {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_round_trips() {
        let s: EngineSpec = "llama-3.3-70b:h100:fp8:tp2".parse().unwrap();
        assert_eq!(s.tp, 2);
        assert_eq!(s.kv, Precision::Fp8);
        assert_eq!(s.to_string(), "llama-3.3-70b:h100:fp8:tp2");
        let s: EngineSpec = "Llama-3.1-8B:H200:fp8:tp1:kv-bf16".parse().unwrap();
        assert_eq!(s.kv, Precision::Bf16);
        assert_eq!(s.to_string(), "llama-3.1-8b:h200:fp8:tp1:kv-bf16");
        let j = serde_json::to_string(&s).unwrap();
        let back: EngineSpec = serde_json::from_str(&j).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn errors_name_the_bad_part_and_the_choices() {
        let e = "llama-70b:h100:fp8:tp2".parse::<EngineSpec>().unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("model `llama-70b`") && m.contains("llama-3.3-70b"),
            "{m}"
        );
        let m = "llama-3.3-70b:a100:fp8:tp2"
            .parse::<EngineSpec>()
            .unwrap_err()
            .to_string();
        assert!(m.contains("device `a100`") && m.contains("h200"), "{m}");
        let m = "llama-3.3-70b:h100:int4:tp2"
            .parse::<EngineSpec>()
            .unwrap_err()
            .to_string();
        assert!(m.contains("precision `int4`") && m.contains("bf16"), "{m}");
        let m = "llama-3.3-70b:h100:fp8:two"
            .parse::<EngineSpec>()
            .unwrap_err()
            .to_string();
        assert!(m.contains("tensor parallel `two`"), "{m}");
        let m = "llama-3.3-70b:h100"
            .parse::<EngineSpec>()
            .unwrap_err()
            .to_string();
        assert!(m.contains("model:device:precision:tpN"), "{m}");
        let e = serde_json::from_str::<EngineSpec>("\"tiny:cpu:bf16:tp0\"").unwrap_err();
        assert!(e.to_string().contains("tensor parallel"), "{e}");
    }
}
