"""The command-line mains: one module per `titan-npu <command>` (titan_npu/cli.py's table), each with its
build_parser() and main(argv). argparse lives here and nowhere else in the package; the work is the library's."""
