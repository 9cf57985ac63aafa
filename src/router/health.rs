//! Active health checks: one probe task per destination, `GET {backend}/health` every health
//! interval; 2xx within the probe timeout marks it up, anything else down (and repairs the
//! plan through the shared state).

use super::state::Shared;
use crate::policy::FleetView;
use std::sync::Arc;

/// One probe task per destination, every health interval, until the router stops.
pub(crate) fn spawn_health_checks(shared: &Arc<Shared>) {
    for d in 0..shared.fleet.len() {
        let s = shared.clone();
        let task = tokio::spawn(async move {
            let url = format!("{}/health", s.fleet.dests[d].url);
            let mut tick = tokio::time::interval(s.cfg.health_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let ok = matches!(
                    tokio::time::timeout(s.cfg.health_timeout, s.client.get(&url).send()).await,
                    Ok(Ok(r)) if r.status().is_success()
                );
                if ok {
                    s.fleet.mark_up(d);
                } else {
                    s.destination_failed(d);
                }
            }
        });
        shared.background.lock().expect("background").push(task);
    }
}
