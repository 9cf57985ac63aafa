//! `cacheroute replay` (being built).

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {}

pub fn run(_a: ReplayArgs) -> anyhow::Result<()> {
    anyhow::bail!("`cacheroute replay` is not built yet")
}
