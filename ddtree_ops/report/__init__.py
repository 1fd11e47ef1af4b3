"""The report of a smoke run (`model`), judged against a baseline of named metrics
(`metric_checks`) or a decode baseline (`baselines` holds it, `decode_checks` judges it), and
drawn as charts (`plots`). Import from the module that holds a name: nothing is re-exported,
so `--help` loads none of it."""
