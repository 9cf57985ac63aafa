fn main() {
    std::process::exit(cacheroute::cli::main());
}
