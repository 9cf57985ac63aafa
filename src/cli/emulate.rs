//! `cacheroute emulate` (being built).

#[derive(clap::Args, Debug)]
pub struct EmulateArgs {}

pub fn run(_a: EmulateArgs) -> anyhow::Result<()> {
    anyhow::bail!("`cacheroute emulate` is not built yet")
}
