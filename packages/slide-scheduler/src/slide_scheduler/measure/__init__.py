"""The probe: this machine's figures (GPU, host memory and AdamW rate, PCIe, disk) as the plan's machine file."""
