"""Step 3's parts below the recipe: rollouts, experience, the four models, rule-based rewards,
the actor's EMA and PTX text (a regular package, so that a non-editable install ships it)."""
