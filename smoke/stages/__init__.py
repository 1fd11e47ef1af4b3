"""One module per smoke stage; the default order lives in `smoke.protocol.STAGE_ORDER`."""
