"""Decode worker: pulls prefilled KV by handle, joins the running batch, streams token batches to gateways."""
