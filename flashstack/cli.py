def main() -> None:
    raise SystemExit("not yet")
