"""Ways of running any recipe: the elastic mode (:mod:`.elastic`) and the faults it is tested with."""
