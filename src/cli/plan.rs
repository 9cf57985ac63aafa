//! `cacheroute plan` and `cacheroute churn` (in progress).
#[derive(clap::Args, Debug)]
pub struct PlanArgs {}
#[derive(clap::Args, Debug)]
pub struct ChurnArgs {}
pub fn run(_a: PlanArgs) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}
pub fn run_churn(_a: ChurnArgs) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}
