//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!` embeds `migrations/` at compile time
//! (as sqlx's documentation of the macro recommends).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
