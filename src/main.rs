//! The `pare` binary: parses the command line and hands over to [`pare::cli`].

fn main() -> std::process::ExitCode {
    pare::cli::main()
}
