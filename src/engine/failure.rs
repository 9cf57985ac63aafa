//! A destination (engine replica) failure to inject into a study: which replica, when it goes
//! down and whether it comes back. The simulator kills its model replica; the live backends
//! kill the engine process.

use serde::{Deserialize, Serialize};

/// A destination failure (and optional recovery) to inject.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Failure {
    pub destination: usize,
    pub at_s: f64,
    #[serde(default)]
    pub recover_at_s: Option<f64>,
}
