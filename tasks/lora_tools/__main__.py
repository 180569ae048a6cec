"""`python -m tasks.lora_tools ...`: the same as the `loraflow-lora` console command."""
from tasks.lora_tools.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
