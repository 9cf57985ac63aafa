//! Rebuild when a migration is added or edited: `sqlx::migrate!` embeds `migrations/` at
//! compile time, and Cargo does not otherwise notice new files there.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
