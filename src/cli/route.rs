//! `cacheroute route` (being built).

#[derive(clap::Args, Debug)]
pub struct RouteArgs {}

pub fn run(_a: RouteArgs) -> anyhow::Result<()> {
    anyhow::bail!("`cacheroute route` is not built yet")
}
