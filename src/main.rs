//! The `pare` binary: parses the command line and hands over to [`pare::cli`].

#[global_allocator]
static GLOBAL: pare::Allocator = pare::Allocator;

fn main() -> std::process::ExitCode {
    pare::tune_allocator();
    pare::cli::main()
}
