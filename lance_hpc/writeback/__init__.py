"""Write-back: what a model says about every row of a dataset, written as new columns of it
(``job: infer``) or reported as metrics (``job: evaluate``), one fragment at a time, one commit at
the end."""
