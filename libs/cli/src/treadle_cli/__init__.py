"""The `treadle` command and what only it uses: the embedded stack (`stack`, `infra`), the run
client, the SFT warm-up, tiny local models and run reports. No service imports this package;
it talks to the services over their APIs (`treadle_common.clients`, `treadle_common.api`)."""
