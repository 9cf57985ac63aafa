//! Active health checks: one probe task per destination, `GET {backend}/health` every health
//! interval; 2xx within the probe timeout marks it up, anything else down (and repairs the
//! plan through the shared state). Each change is logged with the probe's answer; when every
//! destination fails its first probe, one warning names each URL and what it answered (a
//! wrong `--backend` is then visible at start, not as 503s later).

use super::lock::Locked;
use super::state::Shared;
use crate::policy::FleetView;
use std::sync::{Arc, Mutex};

/// What one probe saw: `Ok(status)` for a 2xx, else a one-line reason.
async fn probe(s: &Shared, url: &str) -> Result<u16, String> {
    match tokio::time::timeout(s.cfg.health_timeout, s.client.get(url).send()).await {
        Ok(Ok(r)) if r.status().is_success() => Ok(r.status().as_u16()),
        Ok(Ok(r)) => Err(format!("probe GET {url} answered {}", r.status())),
        // reqwest's own message repeats the URL; its sources say what happened.
        Ok(Err(e)) => Err(format!(
            "probe GET {url} failed: {}",
            match std::error::Error::source(&e) {
                Some(src) => crate::error_chain(src),
                None => e.to_string(),
            }
        )),
        Err(_) => Err(format!(
            "probe GET {url} got no answer within {:?}",
            s.cfg.health_timeout
        )),
    }
}

/// The first probe of every destination: `None` until it answered. When all are in and none
/// passed, the warning is logged once.
struct FirstProbes {
    seen: Mutex<Vec<Option<Result<u16, String>>>>,
}

impl FirstProbes {
    fn note(&self, d: usize, r: &Result<u16, String>) {
        let mut seen = self.seen.locked();
        if let Some(x) = seen.get_mut(d) {
            *x = Some(r.clone());
        }
        if seen.iter().any(Option::is_none) {
            return;
        }
        let failed: Vec<&str> = seen
            .iter()
            .filter_map(|x| x.as_ref().and_then(|r| r.as_ref().err()))
            .map(String::as_str)
            .collect();
        if failed.len() == seen.len() {
            tracing::warn!(
                "every backend failed its first health probe ({}); check each --backend is the engine's base URL (http://HOST:PORT) and that the engines are up",
                failed.join("; ")
            );
        }
    }
}

/// One probe task per destination, every health interval, until the router stops.
pub(crate) fn spawn_health_checks(shared: &Arc<Shared>) {
    // The warning at start is about the backends given at start.
    let at_start = shared.fleet.backends().len();
    let first = Arc::new(FirstProbes {
        seen: Mutex::new(vec![None; at_start]),
    });
    for d in 0..shared.fleet.len() {
        let s = shared.clone();
        let first = first.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(s.cfg.health_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut first_probe = d < at_start;
            loop {
                tick.tick().await;
                // A vacant slot (discovery) waits for a backend.
                if s.fleet.is_vacant(d) {
                    continue;
                }
                let generation = s.fleet.generation(d);
                let url = format!("{}/health", s.fleet.dest(d).url());
                let seen = s.mark(d).probe_started();
                let r = probe(&s, &url).await;
                if first_probe {
                    first.note(d, &r);
                    first_probe = false;
                }
                match r {
                    Ok(status) => s.destination_up(
                        d,
                        &format!("probe GET {url} answered {status}"),
                        seen,
                        generation,
                    ),
                    // A failure seen for a backend the slot no longer holds marks nothing.
                    Err(_) if s.fleet.generation(d) != generation => {}
                    Err(why) => s.destination_failed(d, &why),
                }
            }
        });
        shared.background.locked().push(task);
    }
}
